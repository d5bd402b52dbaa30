"""Capture specialised on the batch values that decide shapes: what is folded, what is not."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vlmcompile.graph.specialize import KnownValues, value_input_tiers
from vlmcompile.ir.errors import CaptureError


class _SplitBySizes(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, sizes):
        noise = torch.rand(int(sizes.sum()), 4)  # a random draw of a known size
        first = (self.lin(x) * noise).split(sizes.tolist())[0]
        return first.sum() * int(sizes[0])


class _Fixed(nn.Module):
    def __init__(self, inner, fixed):
        super().__init__()
        self.inner, self.fixed = inner, fixed

    def forward(self, **batch):
        with KnownValues(self.fixed):
            return self.inner(**batch, **self.fixed)


def test_sizes_from_known_values_are_folded_but_random_draws_stay_in_the_graph():
    model = _Fixed(_SplitBySizes(), {"sizes": torch.tensor([3, 5])})
    gm = torch.export.export(model, (), {"x": torch.randn(8, 4)}, strict=False).module()
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert "aten.rand.default" in targets  # drawn anew every step, not a constant
    assert not any(
        t in ("aten.item.default", "aten._local_scalar_dense.default") for t in targets
    )  # int() folded
    x = torch.randn(8, 4)
    torch.manual_seed(1)
    expected = model(x=x)
    torch.manual_seed(1)
    torch.testing.assert_close(gm(x=x), expected)


def test_the_fewest_inputs_first_and_token_content_never():
    batch = {
        "input_ids": torch.zeros(2, 6, dtype=torch.long),
        "labels": torch.zeros(2, 6, dtype=torch.long),
        "mm_token_type_ids": torch.zeros(2, 6, dtype=torch.long),
        "image_grid_thw": torch.tensor([[1, 4, 4], [1, 4, 4]]),
        "pixel_values": torch.randn(32, 6),
    }
    assert value_input_tiers(batch) == [("image_grid_thw",), ("image_grid_thw", "mm_token_type_ids")]


class _WritesIntoKnown(nn.Module):
    """``pos`` is computed from the known sizes; the model then writes into it."""

    def __init__(self, from_unknown: bool):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.from_unknown = from_unknown

    def forward(self, x, sizes):
        pos = torch.zeros(int(sizes.sum()), 4)
        h = self.lin(x)
        if self.from_unknown:
            pos += h.detach()  # a constant of the graph, bumped every step
        else:
            h = h + pos  # the graph reads pos as a constant ...
            pos += 1  # ... and a later write would change what that read saw
        return (h * pos).sum()


@pytest.mark.parametrize("from_unknown", [True, False])
def test_a_write_into_a_folded_value_is_refused(from_unknown):
    model = _Fixed(_WritesIntoKnown(from_unknown), {"sizes": torch.tensor([3, 5])})
    with pytest.raises(CaptureError, match=r"writes into a value computed from them \((__iadd__|add_)\)"):
        torch.export.export(model, (), {"x": torch.randn(8, 4)}, strict=False)
