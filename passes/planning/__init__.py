"""Our planning passes: stage cuts with recompute, the encoders in the LLM's bubbles, the
search over parallel degrees, and the registry of every policy (see :mod:`vlmcompile.passes`)."""
