"""The baselines, each planned as its users run it, from its own code (see
:mod:`vlmcompile.passes`)."""
