"""Shape formulas: sizes read off a microbatch's inputs, shapes of the values stages send."""

import pytest
import torch

from vlmcompile.ir.errors import PlanError
from vlmcompile.ir.shape_plan import InputSizes, ShapeFormula

SIZES = InputSizes(
    {
        "input_ids": ShapeFormula((1, 64)),
        "pixel_values": ShapeFormula(("4*s0", 294)),
        "cu_seqlens": ShapeFormula(("s1",)),
        "vision_position_ids": ShapeFormula(("4*s0", 2)),
    }
)


def _batch(patches, images):
    return {
        "input_ids": torch.zeros(1, 64),
        "pixel_values": torch.zeros(patches, 294),
        "cu_seqlens": torch.zeros(images + 1),
        "vision_position_ids": torch.zeros(patches, 2),
    }


def test_sizes_are_read_off_the_inputs_and_shapes_follow():
    sizes = SIZES.bind(_batch(48, 3))
    assert sizes == {"s0": 12, "s1": 4}
    assert ShapeFormula(("4*s0", 32)).evaluate(sizes) == (48, 32)
    assert ShapeFormula(("((16*s0)//s1)", "s1 - 1")).evaluate(sizes) == (48, 3)
    assert ShapeFormula.of(torch.zeros(2, 3)).dims == (2, 3) and ShapeFormula.of(7).dims == ()


def test_inputs_the_pipeline_cannot_take_are_named():
    with pytest.raises(PlanError, match=r"'input_ids' is \[1, 64, 1\]"):
        SIZES.bind(_batch(48, 3) | {"input_ids": torch.zeros(1, 64, 1)})
    with pytest.raises(PlanError, match="dimension 1 is fixed at 64"):
        SIZES.bind(_batch(48, 3) | {"input_ids": torch.zeros(1, 65)})
    with pytest.raises(PlanError, match="a whole number of the family's units"):
        SIZES.bind(_batch(46, 3))  # 46 patches are not whole 2 x 2 merge units
    with pytest.raises(PlanError, match="should be 48 from the other inputs' sizes"):
        SIZES.bind(_batch(48, 3) | {"vision_position_ids": torch.zeros(44, 2)})
