"""Codegen: a plan's stage modules, or a contrastive model's tower modules, split out of the
captured graph (see :mod:`vlmcompile.passes`)."""
