"""Fixtures the planning tests share."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def clip_s():
    """DistMM's CLIP-S as the contrastive benchmark plans it: its LayerGraph on meta tensors and
    its loss recognised on a narrow copy (about 6 s: built once)."""
    from vlmcompile.compiler import zoo_contrastive_loss, zoo_layer_graph

    return zoo_layer_graph("CLIP-S"), zoo_contrastive_loss("CLIP-S")
