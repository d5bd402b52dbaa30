"""Samples of a global batch packed into microbatches of a fixed token budget.

Every microbatch is ``rows`` rows of ``tokens`` LLM tokens whatever its samples, so the LLM's
stage boundaries never change shape. Inside a row, samples sit one after the other and never
see each other: the attention mask is block-diagonal and causal per sample (a 4-D boolean mask,
which transformers models take as it is), positions restart at every sample (Qwen's 3-D M-RoPE
positions too), and the first label of every sample is ignored, so the last token of one sample
does not learn to predict the next sample. Padding tokens attend to themselves only and carry no
label. Loss and gradients then equal those of the same samples right-padded in one batch
(:func:`padded_batch`, what ``model(**batch).loss`` trains on), tested for every family.

The images of a microbatch are its samples' images joined in token order (the family's layout).

Rules, stated once:
* A sample longer than ``tokens`` is refused (:class:`DataError` naming it and its length):
  cutting text or image tokens would train on something else than the dataset holds.
* A sample's own padding (0 in its ``attention_mask``, at its start or end) is dropped, and its
  tokens keep the positions eager gives them (:func:`~vlmcompile.data.families.attended`).
* Samples go longest first to the emptiest row they fit (a balanced first fit); what fits in
  no row of this step is *deferred*, returned to the caller to open the next step with,
  never dropped.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vlmcompile.data.families import (
    Family,
    PatchStreamFamily,
    Sample,
    attended,
    labels_of,
    raw_labels,
    tokens_of,
)
from vlmcompile.ir.errors import DataError, positive_int
from vlmcompile.ir.microbatch import IGNORE_INDEX

PAD_TOKEN = 0
"""Token id of padding: never attended to by a sample's token and never a label."""


def check_samples(samples: Any) -> list[Mapping[str, Any]]:
    """``samples`` as a list of per-sample dicts, or a :class:`DataError` saying what is off."""
    if not isinstance(samples, Sequence) or isinstance(samples, (str, bytes)):
        raise DataError(f"samples is a {type(samples).__name__}; give a list of per-sample dicts")
    if not samples:
        raise DataError("the sample list is empty; give at least one sample (a dict of its tensors)")
    bad = next((i for i, s in enumerate(samples) if not isinstance(s, Mapping)), None)
    if bad == 0:
        raise DataError(
            f"the sample batch is a {type(samples).__name__} of {type(samples[0]).__name__}; give a dict of the "
            "model's inputs (one batch of one shape), or a list of per-sample dicts (samples of different shapes)"
        )
    if bad is not None:
        raise DataError(
            f"sample {bad} is a {type(samples[bad]).__name__}; give each sample as a dict of its tensors "
            "(input_ids, labels and its images, as the model's processor returns them for one example)"
        )
    return list(samples)


_NOT_PACKED = ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts", "position_ids", "inputs_embeds")
"""Inputs of a dict batch the packed path does not take apart (videos; what it computes itself)."""
_SPLIT_KEYS = frozenset(
    {"input_ids", "labels", "attention_mask", "pixel_values", "image_grid_thw", "mm_token_type_ids"}
)
"""What a Qwen-VL dict batch is split by (``mm_token_type_ids`` is derived again when packing)."""


def samples_of(batch: Any, family: Family) -> list[Mapping[str, Any]]:
    """The samples a pipeline for samples of different shapes packs: a list as given, or a dict
    batch of a Qwen-VL family split into its samples (:func:`split_batch`)."""
    if isinstance(batch, Mapping):
        return split_batch(batch, family)
    return check_samples(batch)


def split_batch(batch: Mapping[str, Any], family: Family) -> list[dict[str, Any]]:
    """A collated dict batch of a Qwen-VL family (right- or left-padded rows, images as flat
    patches in row order) as its samples: each row's tokens, labels and mask, and the images its
    image tokens take, in order (``mm_token_type_ids`` is left out: packing derives it).

    Raises:
        DataError: another family, videos, or image tokens that do not match the images' grids.
    """
    if not isinstance(family, PatchStreamFamily):
        raise DataError(
            f"this pipeline packs {family.name} samples of different shapes: give the step's samples as a list of "
            "per-sample dicts, not a dict batch"
        )
    ids, labels = batch.get("input_ids"), batch.get("labels")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or not isinstance(labels, torch.Tensor):
        raise DataError(
            "the dict batch needs input_ids and labels of shape (samples, length); or give a list of per-sample dicts"
        )
    videos = [k for k in _NOT_PACKED if k in batch]
    if videos:
        raise DataError(f"the dict batch holds {videos}; the packed path takes images only: give samples")
    unknown = sorted(set(batch) - _SPLIT_KEYS)
    if unknown:
        raise DataError(
            f"the dict batch holds {unknown}, which splitting it into samples would leave out; give a list of "
            f"per-sample dicts (or drop them: the keys taken are {', '.join(sorted(_SPLIT_KEYS))})"
        )
    grids = batch.get("image_grid_thw")
    if (grids is None) != (batch.get("pixel_values") is None):
        raise DataError(
            "the dict batch needs pixel_values and image_grid_thw together (or neither, text only)"
        )
    mask = batch.get("attention_mask")
    rows = [
        {"input_ids": ids[i : i + 1], "labels": labels[i : i + 1]}
        | ({"attention_mask": mask[i : i + 1]} if mask is not None else {})
        for i in range(ids.shape[0])
    ]
    patches = [] if grids is None else [int(p) for p in grids.prod(-1)]
    if grids is not None and sum(patches) != batch["pixel_values"].shape[0]:
        raise DataError(
            f"the dict batch's image_grid_thw makes {sum(patches)} patches, but pixel_values holds "
            f"{batch['pixel_values'].shape[0]}: give the images' patches and grids alike"
        )
    image, patch = 0, 0
    for i, row in enumerate(rows):
        wanted = int((row["input_ids"][0, attended(row, f"row {i}")] == family.image_token_id).sum())
        first, got = image, 0
        while got < wanted and image < len(patches):
            got += patches[image] // family.merge**2
            image += 1
        if got != wanted:
            raise DataError(
                f"row {i} of the dict batch has {wanted} image tokens where the images left make {got}: check "
                "image_grid_thw, or give a list of per-sample dicts"
            )
        if image > first:
            used = sum(patches[first:image])
            row["pixel_values"] = batch["pixel_values"][patch : patch + used]
            row["image_grid_thw"] = grids[first:image]
            patch += used
    if image != len(patches):
        raise DataError(f"the dict batch has {len(patches) - image} images that no row's image tokens take")
    return rows


def too_long(name: str, length: int, tokens: int, over: int = 1, of: int | None = None) -> DataError:
    """The error for a sample longer than a microbatch's ``tokens``: it names the sample, how
    many more there are, and the fix."""
    more = f" ({over} of {of} samples are)" if of is not None and over > 1 else ""
    return DataError(
        f"{name} takes {length} LLM tokens, more than a microbatch's {tokens}{more}; plan for microbatches of "
        f"at least {length} (vlmcompile plan --data ... --tokens-per-microbatch {length}; compile(..., "
        f"tokens_per_microbatch={length})), or leave such samples out of the dataset (vlmcompile cuts neither "
        "text nor images)"
    )


def sample_name(dataset: Any, index: int) -> str:
    """``dataset sample 2090`` and, where the dataset says (a manifest's line), where it comes from."""
    where = getattr(dataset, "where", None)
    said = where(index) if callable(where) else None
    return f"dataset sample {index}" + (f" ({said})" if said else "")


def check_budget(tokens: int, longest: str) -> None:
    """Refuse a token budget whose microbatches this machine could not build: a packed row's
    attention mask alone is ``tokens x tokens`` booleans (named by the sample that sets it)."""
    mask = tokens * tokens
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if mask > memory // 2:
        raise DataError(
            f"{longest} makes microbatches of {tokens} LLM tokens, whose attention mask alone takes "
            f"{mask / 2**30:.3g} GiB a row, more than half of this machine's {memory / 2**30:.3g} GiB; leave such "
            "samples out, or check its size (a manifest's text_tokens counts the sample's text tokens)"
        )


def sample_length(sample: Sample, family: Family, index: int | str) -> int:
    """The sample's LLM tokens (its padding dropped), after checking it is one of ``family``'s
    samples whose image tokens match its images and whose images are of a type the model takes
    (a :class:`DataError` naming sample ``index``, or the name given, and the fix)."""
    where = index if isinstance(index, str) else f"sample {index}"
    ids = tokens_of(sample, where)
    labels_of(sample, where)
    image_keys = {"pixel_values", "image_grid_thw", "image_sizes", "pixel_attention_mask", "image_flags"}
    foreign = sorted(k for k in sample if k in image_keys and k not in family.image_keys)
    if foreign:
        raise DataError(
            f"{where} holds {foreign}, which {family.name} models do not take: it was made for another model "
            f"family; build the dataset with the model's own processor (its images go in {list(family.image_keys)})"
        )
    pixels = sample.get("pixel_values")
    if isinstance(pixels, torch.Tensor) and not pixels.is_floating_point():
        raise DataError(
            f"{where}: pixel_values are {pixels.dtype}, not floating point (raw pixels?); give what the model's "
            "image processor returns (rescaled and normalised floats), or convert them yourself"
        )
    found = int((ids == family.image_token_id).sum())
    expected = family.expected_image_tokens(sample, where)
    if found != expected:
        raise DataError(
            f"{where} has {found} image tokens (id {family.image_token_id}) where its images make {expected}; "
            "the processor that made it expanded the image placeholders for another image size or model: "
            "process the sample with this model's processor"
        )
    return int(ids.numel())


@dataclass(frozen=True, slots=True)
class PackedMicrobatch:
    inputs: dict[str, torch.Tensor]
    """The model's inputs: ``input_ids``, ``labels``, ``position_ids``, a 4-D ``attention_mask``
    and the images."""
    samples: tuple[tuple[int, ...], ...]
    """Per row, the indices (in the packed sample list) of its samples, in order."""
    tokens: int
    """Sample tokens in it (the rest is padding)."""
    vision_rows: int
    """Rows of image input (tiles or patches) it carries."""


@dataclass(frozen=True, slots=True)
class Packing:
    microbatches: tuple[PackedMicrobatch, ...]
    deferred: tuple[int, ...]
    """Samples that fit in no row of this step, for the next."""
    tokens_per_row: int
    label_tokens: int
    """Label tokens of the packed samples: the loss of the step is their mean, so each
    microbatch's loss is its sum over this count (transformers' ``num_items_in_batch``)."""

    @property
    def pad_share(self) -> float:
        capacity = sum(mb.inputs["input_ids"].numel() for mb in self.microbatches)
        return 1 - sum(mb.tokens for mb in self.microbatches) / capacity


def assign_rows(
    lengths: Sequence[int], num_rows: int, tokens: int, *, first: int = 0
) -> tuple[list[list[int]], list[int]]:
    """Sample indices per row (longest first, each to the emptiest row it fits; a row keeps its
    samples in index order) and the indices that fit nowhere. The first ``first`` samples (those
    a step carries in) are placed before the others."""
    rows: list[list[int]] = [[] for _ in range(num_rows)]
    used = [0] * num_rows
    deferred = []
    ahead = sorted(range(first), key=lambda i: (-lengths[i], i))
    rest = sorted(range(first, len(lengths)), key=lambda i: (-lengths[i], i))
    for i in [*ahead, *rest]:
        fits = [r for r in range(num_rows) if used[r] + lengths[i] <= tokens]
        if not fits:
            deferred.append(i)
            continue
        r = min(fits, key=lambda r: (used[r], r))
        rows[r].append(i)
        used[r] += lengths[i]
    return [sorted(r) for r in rows], sorted(deferred)


def fewest_rows(lengths: Sequence[int], tokens: int) -> int:
    """The fewest rows of ``tokens`` that :func:`assign_rows` fits samples of ``lengths`` into
    (each at most ``tokens``)."""
    rows = max(1, -(-sum(lengths) // tokens))
    while assign_rows(lengths, rows, tokens)[1] and rows < len(lengths):
        rows += 1
    return rows


def pack(
    samples: Sequence[Sample], family: Family, *, tokens: int, num_microbatches: int, rows: int = 1
) -> Packing:
    """``samples`` in ``num_microbatches`` microbatches of ``rows`` x ``tokens`` LLM tokens."""
    positive_int("tokens", tokens, "the LLM tokens of one microbatch row")
    positive_int("num_microbatches", num_microbatches, "the microbatches of one step")
    positive_int("rows", rows, "the rows of one microbatch")
    if not samples:
        raise DataError("no samples to pack; give a global batch of at least one sample")
    lengths = [sample_length(s, family, i) for i, s in enumerate(samples)]
    over = [i for i, n in enumerate(lengths) if n > tokens]
    if over:
        i = max(over, key=lambda i: lengths[i])
        raise too_long(f"sample {i}", lengths[i], tokens, len(over), len(samples))
    per_row, deferred = assign_rows(lengths, num_microbatches * rows, tokens)
    return pack_assigned(samples, family, per_row, tokens, rows=rows, deferred=deferred)


def pack_assigned(
    samples: Sequence[Sample],
    family: Family,
    per_row: Sequence[Sequence[int]],
    tokens: int,
    *,
    rows: int = 1,
    deferred: Sequence[int] = (),
    names: Sequence[str] | None = None,
    lengths: Sequence[int] | None = None,
) -> Packing:
    """The microbatches of an assignment of samples to rows (:func:`assign_rows`'), ``rows``
    rows a microbatch; ``names``: how messages name the samples (default ``sample i``);
    ``lengths``: their :func:`sample_length`, where the caller has them."""
    names = names or [f"sample {i}" for i in range(len(samples))]
    if lengths is None:
        lengths = [sample_length(s, family, names[i]) for i, s in enumerate(samples)]
    microbatches = tuple(
        _microbatch(samples, [list(r) for r in per_row[k : k + rows]], family, tokens, lengths, names)
        for k in range(0, len(per_row), rows)
    )
    label_tokens = sum(int((mb.inputs["labels"] != IGNORE_INDEX).sum()) for mb in microbatches)
    return Packing(microbatches, tuple(deferred), tokens, label_tokens)


def _microbatch(
    samples: Sequence[Sample],
    rows: list[list[int]],
    family: Family,
    tokens: int,
    lengths: Sequence[int],
    names: Sequence[str],
) -> PackedMicrobatch:
    n = len(rows)
    ids = torch.full((n, tokens), PAD_TOKEN, dtype=torch.long)
    labels = torch.full((n, tokens), IGNORE_INDEX, dtype=torch.long)
    segment = torch.full((n, tokens), -1, dtype=torch.long)
    stream = isinstance(family, PatchStreamFamily)
    positions = torch.zeros((3, n, tokens) if stream else (n, tokens), dtype=torch.long)
    for r, row in enumerate(rows):
        start = 0
        for i in row:
            end = start + lengths[i]
            ids[r, start:end] = tokens_of(samples[i], names[i])
            labels[r, start:end] = labels_of(samples[i], names[i])
            labels[r, start] = IGNORE_INDEX  # nothing before it in its sample predicts it
            segment[r, start:end] = i
            positions[..., r, start:end] = family.positions(samples[i])
            start = end
    inputs = {
        "input_ids": ids,
        "labels": labels,
        "attention_mask": packed_attention_mask(segment),
        "position_ids": positions,
    }
    for key in family.token_keys:
        inputs[key] = (ids == family.image_token_id).long()
    in_order = [samples[i] for row in rows for i in row]
    # Images of any floating dtype (a processor's fp32, a dataset's fp16) as fp32: the model casts
    # them to its own, as in eager, and every microbatch has the dtype the pipeline was captured at.
    inputs.update(
        {k: v.float() if v.is_floating_point() else v for k, v in family.join_images(in_order).items()}
    )
    return PackedMicrobatch(
        inputs,
        tuple(tuple(row) for row in rows),
        sum(lengths[i] for row in rows for i in row),
        sum(family.vision_rows(s) for s in in_order),
    )


def packed_attention_mask(segment: torch.Tensor) -> torch.Tensor:
    """(rows, 1, tokens, tokens) boolean mask, True where a query may attend to a key: earlier or
    the same position of its own sample (``segment`` holds each token's sample, -1 on padding,
    which attends to itself alone so that no row of the mask is empty)."""
    tokens = segment.shape[-1]
    causal = torch.ones(tokens, tokens, dtype=torch.bool).tril()
    same = (segment[:, :, None] == segment[:, None, :]) & (segment[:, :, None] >= 0)
    return ((same & causal) | torch.eye(tokens, dtype=torch.bool))[:, None]


def padded_batch(samples: Sequence[Sample], family: Family) -> dict[str, torch.Tensor]:
    """The samples right-padded into one batch, as a transformers training loop feeds them:
    a 0/1 ``attention_mask`` (a sample's own padding kept, as it was given), labels -100 on
    padding, the images joined in sample order."""
    for i, s in enumerate(samples):
        sample_length(s, family, i)  # checked as packing checks it
    longest = max(int(s["input_ids"].numel()) for s in samples)
    ids = torch.full((len(samples), longest), PAD_TOKEN, dtype=torch.long)
    labels = torch.full((len(samples), longest), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(samples), longest), dtype=torch.long)
    for i, s in enumerate(samples):
        n = int(s["input_ids"].numel())
        kept = attended(s, f"sample {i}")
        ids[i, :n], labels[i, :n] = s["input_ids"].reshape(-1), raw_labels(s, f"sample {i}")
        mask[i, kept] = 1
    batch = {"input_ids": ids, "labels": labels, "attention_mask": mask}
    for key in family.token_keys:
        batch[key] = (ids == family.image_token_id).long()
    batch.update(family.join_images(samples))
    return batch
