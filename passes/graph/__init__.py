"""Graph passes: capture the model, annotate every node and layer, time the layers (see the
tour in :mod:`vlmcompile.passes`)."""
