"""Packing: samples of any image count and length in fixed-size microbatches, trained exactly
like the same samples right-padded in one batch (``model(**padded).loss``), on the transformers
models the families describe."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.models import needs_transformers
from vlmcompile import families
from vlmcompile.data.families import TileFamily
from vlmcompile.data.packing import assign_rows, pack, packed_attention_mask, padded_batch, sample_length
from vlmcompile.data.synthetic import SyntheticDataset
from vlmcompile.ir.errors import DataError

TINY = TileFamily("llava", image_token_id=100, side=28, channels=3, tokens_per_tile=4, max_tiles=1)

DATASETS = {  # family -> (distribution, pixel scale to the tiny models' 28 px)
    "hf-llava": ("llava-chat", 28 / 640),
    "hf-llava-next": ("qwen-native", 1 / 16),  # anyres: crops by image size
    "hf-internvl": ("internvl-tiles", 28 / 448),
    "hf-idefics3": ("interleaved", 28 / 640),  # image splitting: tiles and a global view
    "hf-smolvlm": ("interleaved", 28 / 640),  # the same, in SmolVLM's classes
    "hf-qwen2-vl": ("qwen-native", 1 / 16),
    "hf-qwen2.5-vl": ("interleaved", 28 / 640),
    "hf-qwen3-vl": ("qwen-native", 1 / 16),  # deepstack features and a learned position table
}


def _gradients(model):
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@needs_transformers
@pytest.mark.parametrize("name", sorted(DATASETS))
def test_packed_microbatches_train_like_the_padded_batch(name):
    model = families.build_tiny_by_name(name, batch=1)[0]
    family = families.layout_of(model)
    distribution, pixel_scale = DATASETS[name]
    dataset = SyntheticDataset(
        distribution, family, 64, seed=1, text_only=0.25, text_scale=1 / 30, pixel_scale=pixel_scale
    )
    text_only = next(i for i in range(6, 64) if not dataset.sizes(i).images)
    samples = [dataset[i] for i in [*range(6), text_only]]
    rows = [family.vision_rows(s) for s in samples]
    assert 0 in rows and max(rows) > 0 and len({s["input_ids"].numel() for s in samples}) > 3

    padded = padded_batch(samples, family)
    expected = model(**padded).loss
    expected.backward()
    expected_grads = _gradients(model)

    lengths = [s["input_ids"].numel() for s in samples]
    budget = max(max(lengths), sum(lengths) // 3) + 5  # room for all 7 in 4 rows
    packing = pack(samples, family, tokens=budget, num_microbatches=4)
    assert not packing.deferred and sorted(
        i for mb in packing.microbatches for row in mb.samples for i in row
    ) == list(range(7))
    assert all(mb.inputs["input_ids"].shape == (1, budget) for mb in packing.microbatches)  # static
    _check_packed_equals_eager(model, family, packing, expected, expected_grads)


def _check_packed_equals_eager(
    model, family, packing, expected, expected_grads, *, zoo: bool = False
) -> None:
    """The packed microbatches' losses add up to eager's, and their gradients to eager's (a
    transformers model takes the inputs as they are, the zoo's through its packed step)."""
    from vlmcompile.data.packed_step import PackedStep, step_inputs

    step = PackedStep(model, family) if zoo else None
    total = 0
    for mb in packing.microbatches:
        if step is not None:
            loss = step(**step_inputs(mb, family, packing.label_tokens))
        else:
            loss = model(**mb.inputs, num_items_in_batch=torch.tensor(packing.label_tokens)).loss
        loss.backward()
        total = total + loss.detach()
    torch.testing.assert_close(total, expected.detach())
    grads = _gradients(model)
    assert grads.keys() == expected_grads.keys()
    for key, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[key], msg=key)


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=20),
    rows=st.integers(1, 5),
    tokens=st.integers(1, 60),
)
def test_every_sample_lands_in_one_row_or_is_deferred(lengths, rows, tokens):
    per_row, deferred = assign_rows(lengths, rows, tokens)
    placed = [i for row in per_row for i in row]
    assert sorted(placed + deferred) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= tokens for row in per_row)
    free = [tokens - sum(lengths[i] for i in row) for row in per_row]
    assert all(lengths[i] > max(free) for i in deferred)  # deferred only what fits nowhere


@settings(max_examples=100, deadline=None)
@given(lengths=st.lists(st.integers(1, 6), min_size=1, max_size=5), pad=st.integers(0, 4))
def test_no_token_attends_across_samples_or_to_the_future(lengths, pad):
    segment = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)] + [torch.full((pad,), -1)])[None]
    mask = packed_attention_mask(segment)[0, 0]
    q, k = torch.meshgrid(torch.arange(len(segment[0])), torch.arange(len(segment[0])), indexing="ij")
    s = segment[0]
    own = (s[q] == s[k]) & (k <= q) & (s[q] >= 0)
    torch.testing.assert_close(mask, own | (q == k))
    assert mask.any(-1).all()  # no query without a key: softmax stays finite


def _sample(tokens, tiles, image_tokens=None):
    ids = torch.randint(3, 90, (tokens,))
    ids[1 : 1 + (4 * tiles if image_tokens is None else image_tokens)] = 100
    return {
        "input_ids": ids[None],
        "labels": ids[None].clone(),
        "pixel_values": torch.zeros(tiles, 3, 28, 28),
    }


def test_what_fits_in_no_row_is_deferred_to_the_next_step():
    samples = [_sample(10, 1), _sample(9, 0), _sample(8, 1), _sample(7, 0)]
    packing = pack(samples, TINY, tokens=12, num_microbatches=2)
    assert packing.deferred == (2, 3)  # 8 and 7 tokens: 2 and 3 are left in the rows
    assert [mb.samples for mb in packing.microbatches] == [((0,),), ((1,),)]
    assert packing.pad_share == pytest.approx(1 - 19 / 24)


def test_bad_samples_are_refused_naming_them():
    with pytest.raises(DataError, match="sample 1 has 3 image tokens .* where its images make 4"):
        pack([_sample(10, 1), _sample(10, 1, image_tokens=3)], TINY, tokens=16, num_microbatches=1)
    with pytest.raises(DataError, match="sample 1 takes 30 LLM tokens, more than a microbatch's 16"):
        pack([_sample(10, 1), _sample(30, 1)], TINY, tokens=16, num_microbatches=1)
    with pytest.raises(DataError, match="no samples to pack"):
        pack([], TINY, tokens=16, num_microbatches=1)
    foreign = _sample(10, 1) | {"image_grid_thw": torch.tensor([[1, 2, 2]])}
    with pytest.raises(DataError, match=r"sample 0 holds \['image_grid_thw'\].* another model family"):
        sample_length(foreign, TINY, 0)
    with pytest.raises(DataError, match="sample 0 has no labels"):
        sample_length({"input_ids": torch.ones(1, 4, dtype=torch.long)}, TINY, 0)
    with pytest.raises(DataError, match=r"pixel_values is \[1, 3, 14, 14\]"):
        sample_length(_sample(10, 0) | {"pixel_values": torch.zeros(1, 3, 14, 14)}, TINY, 0)


@pytest.mark.parametrize(
    "name, assignment",
    [
        ("tiny", "tokens"),
        ("tiny-two-encoder", "tokens"),
        ("tiny-tied", "tokens"),
        ("tiny", "greedy"),
        ("tiny", "cp-sat"),
    ],
)
def test_the_zoos_vlms_pack_like_their_padded_batch(name, assignment):
    """The zoo's own VLMs (one or two encoders, a tied head) take packed microbatches too, the
    samples assigned to microbatches by tokens or by image rows and tokens (no numerics change)."""
    from vlmcompile import models
    from vlmcompile.data.microbatches import assign
    from vlmcompile.data.packed_step import PackedStep, step_inputs
    from vlmcompile.data.packing import pack_assigned

    model = models.build(name)
    family = families.layout_of(model)
    assert family.name == "zoo" and family.image_token_id == model.cfg.llm.vocab - 1
    data = SyntheticDataset(
        "interleaved", family, 40, seed=1, text_only=0.3, text_scale=1 / 30, pixel_scale=16 / 640
    )
    samples = [data[i] for i in range(8)]
    expected = model(**padded_batch(samples, family))
    expected.backward()
    expected_grads = _gradients(model)
    lengths = [s["input_ids"].numel() for s in samples]
    budget = max(max(lengths), sum(lengths) // 3)
    vision = [family.vision_rows(s) for s in samples]
    made = assign(lengths, vision, 4, budget, replicas=2, method=assignment)
    assert made.method.startswith(assignment) and not made.deferred
    packing = pack_assigned(samples, family, made.rows, budget)
    step = PackedStep(model, family)
    total = 0
    for mb in packing.microbatches:
        loss = step(**step_inputs(mb, family, packing.label_tokens))
        loss.backward()
        total = total + loss.detach()
    torch.testing.assert_close(total, expected.detach())
    for key, grad in _gradients(model).items():
        torch.testing.assert_close(grad, expected_grads[key], msg=key)


def _padded(sample, length: int, side: str, pad_id: int = 0) -> dict:
    """``sample`` padded to ``length`` tokens on ``side`` as a tokenizer pads it: pad tokens with
    mask 0 and label -100 (and, on the left, the first real token's label -100 too: eager predicts
    it from padding alone)."""
    ids, labels = sample["input_ids"].reshape(-1), sample["labels"].reshape(-1).clone()
    pad = length - ids.numel()
    if side == "left":
        labels[0] = -100
    fill = torch.full((pad,), pad_id, dtype=ids.dtype)
    ignore = torch.full((pad,), -100, dtype=labels.dtype)
    ones, zeros = torch.ones(ids.numel(), dtype=torch.long), torch.zeros(pad, dtype=torch.long)
    parts = (fill, ids), (ignore, labels), (zeros, ones)
    ids, labels, mask = (torch.cat(p if side == "left" else p[::-1]) for p in parts)
    return {**sample, "input_ids": ids[None], "labels": labels[None], "attention_mask": mask[None]}


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("name", ["tiny", pytest.param("hf-llava", marks=needs_transformers)])
def test_a_sample_s_own_padding_is_dropped_as_eager_masks_it(name, side):
    """Samples padded by their tokenizer (a 0/1 attention_mask) train like eager on the padded
    batch: packing keeps their tokens only, at the positions eager gives them."""
    from vlmcompile import models

    if name == "tiny":
        model = models.build(name)
    else:
        model = families.build_tiny_by_name(name, batch=1)[0]
    family = families.layout_of(model)
    data = SyntheticDataset(
        "interleaved", family, 16, seed=3, text_only=0.3, text_scale=1 / 30, pixel_scale=28 / 640
    )
    given = [data[i] for i in range(5)]
    longest = max(s["input_ids"].numel() for s in given) + 3  # every sample padded, the longest too
    samples = [_padded(s, longest, side) for s in given]
    batch = {k: torch.cat([s[k] for s in samples]) for k in ("input_ids", "labels", "attention_mask")}
    batch.update(family.join_images(samples))
    out = model(**batch)
    expected = out if isinstance(out, torch.Tensor) else out.loss
    expected.backward()
    expected_grads = _gradients(model)

    real = [int(s["attention_mask"].sum()) for s in samples]
    budget = max(real) + sum(real) // 2
    packing = pack(samples, family, tokens=budget, num_microbatches=3)
    assert not packing.deferred and sum(mb.tokens for mb in packing.microbatches) == sum(real)
    _check_packed_equals_eager(model, family, packing, expected, expected_grads, zoo=name == "tiny")


def test_padding_packing_cannot_reproduce_is_refused_naming_the_sample():
    sample = _sample(6, 1)
    left = _padded(sample, 9, "left")
    on_padding = left["labels"].clone()
    on_padding[0, 0] = 7
    with pytest.raises(DataError, match="sample 0: 1 labels on its padding"):
        pack([{**left, "labels": on_padding}], TINY, tokens=16, num_microbatches=1)
    first = left["labels"].clone()
    first[0, 3] = 5  # the first real token's label
    with pytest.raises(DataError, match="sample 0: left-padded, and its first token has label 5"):
        pack([{**left, "labels": first}], TINY, tokens=16, num_microbatches=1)
    holed = left["attention_mask"].clone()
    holed[0, 5] = 0
    with pytest.raises(DataError, match="sample 0: its attention_mask has 0s between its tokens"):
        pack([{**left, "attention_mask": holed}], TINY, tokens=16, num_microbatches=1)
    with pytest.raises(DataError, match="sample 0: pixel_values are torch.uint8"):
        pack(
            [{**sample, "pixel_values": sample["pixel_values"].to(torch.uint8)}],
            TINY,
            tokens=16,
            num_microbatches=1,
        )


def test_a_qwen_dict_batch_splits_into_its_samples_and_refuses_what_it_would_drop():
    from vlmcompile.data.packing import split_batch
    from vlmcompile.families import released_layouts

    family = released_layouts()["qwen2-vl"]
    ids = torch.tensor([[5, 2, 1, 1, 3, 6, 0], [7, 2, 1, 3, 2, 1, 3]])  # row 0: one image, padded; row 1: two
    batch = {
        "input_ids": ids,
        "labels": ids.masked_fill(ids == 1, -100),
        "attention_mask": torch.tensor([[1, 1, 1, 1, 1, 1, 0], [1] * 7]),
        "pixel_values": torch.arange(16 * 3, dtype=torch.float32).reshape(16, 3),
        "image_grid_thw": torch.tensor([[1, 2, 4], [1, 2, 2], [1, 2, 2]]),  # 2, 1 and 1 tokens (merge 2)
    }
    first, second = split_batch(batch, family)
    assert first["image_grid_thw"].tolist() == [[1, 2, 4]] and torch.equal(
        first["pixel_values"], batch["pixel_values"][:8]
    )
    assert second["image_grid_thw"].tolist() == [[1, 2, 2], [1, 2, 2]]
    assert torch.equal(second["pixel_values"], batch["pixel_values"][8:])
    assert first["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 1, 0]]
    with pytest.raises(DataError, match=r"holds \['second_per_grid_ts'\]|holds \['cache_position'\]"):
        split_batch({**batch, "cache_position": torch.arange(7)}, family)
    with pytest.raises(DataError, match="makes 16 patches, but pixel_values holds 12"):
        split_batch({**batch, "pixel_values": batch["pixel_values"][:12]}, family)
    wrong = batch["image_grid_thw"].clone()
    wrong[0] = torch.tensor([1, 2, 2])
    with pytest.raises(DataError, match="makes 12 patches|row 0 of the dict batch has 2 image tokens"):
        split_batch({**batch, "image_grid_thw": wrong}, family)
