"""One packed microbatch as a transformers VLM trains on it: the inputs the data path completes
on the host, and :class:`PackedStep`, the module capture exports once for every microbatch.

What varies between microbatches is only the vision side (images, tiles, patches); the LLM side
is ``rows x tokens`` always. So the step is exported with the vision sizes as dynamic dimensions
(:func:`dynamic_shapes`), and everything else static. What a model would compute from tensor
*values* to find shapes - Qwen's vision positions, attention segments, window index and
position-table resampling - is computed on the host by each family's ``step_images`` (with
transformers' own ``vision_utils`` functions, so it is the model's own arithmetic) and enters
the graph as inputs, as transformers' exporter does.

Rules the graph relies on, stated once:
* A microbatch without images gets one dummy image (zeros, the smallest the family takes)
  whose features are dropped: ``image_token_index`` selects the features that fill the image
  tokens (all of them, or none). So the vision encoder never runs on zero rows (its reshapes
  cannot tell an empty batch's sizes apart) and a text-only microbatch costs one small image.
* Every microbatch's loss is its sum over the label tokens of the whole step
  (``num_items_in_batch``), so the microbatch losses add up to the step's mean loss with no
  weights, and a microbatch of padding contributes zero.
* Qwen's vision attention, which splits per image with a data-dependent ``tolist()``, runs as
  one attention over the patch stream with a block-diagonal mask made from ``cu_seqlens``
  (:func:`segment_attention`), registered for the capture only.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from vlmcompile.data.families import Family, PatchStreamFamily
from vlmcompile.data.packing import PackedMicrobatch, pack
from vlmcompile.ir.errors import ModelError
from vlmcompile.ir.packed import PackedBatch

SEGMENT_ATTENTION = "vlmcompile_flash_segments"
"""Name of :func:`segment_attention` among transformers' attention functions ("flash" in it
makes Qwen's vision attention take its ``cu_seqlens`` branch: one call for all images)."""

LLM_KEYS = ("input_ids", "labels", "attention_mask", "position_ids", "num_items_in_batch")
"""Inputs of fixed shape (``num_items_in_batch`` is 0-d)."""


def dummy_images(family: Family) -> dict[str, torch.Tensor]:
    """The smallest image the family takes, as its step's vision inputs."""
    if isinstance(family, PatchStreamFamily):
        merge = family.merge
        return family.step_images(
            {
                "pixel_values": torch.zeros(merge * merge, family.patch_dim),
                "image_grid_thw": torch.tensor([[1, merge, merge]]),
            }
        )
    return {"pixel_values": torch.zeros(1, family.channels, family.side, family.side)}  # a tile, a crop


def step_inputs(microbatch: PackedMicrobatch, family: Family, label_tokens: int) -> dict:
    """The packed microbatch's inputs as :class:`PackedStep` takes them: its images as the
    family's step takes them (or a dummy image), which image features fill its image tokens,
    and the step's label count."""
    inputs = {k: microbatch.inputs[k] for k in ("input_ids", "labels", "attention_mask", "position_ids")}
    inputs["num_items_in_batch"] = torch.tensor(label_tokens)
    if microbatch.vision_rows:  # (a family may carry an empty pixel_values when it has none)
        inputs.update(
            family.step_images({k: microbatch.inputs[k] for k in family.image_keys if k in microbatch.inputs})
        )
    else:
        inputs.update(dummy_images(family))
    if "image_token_index" not in inputs:  # every feature fills an image token, in order
        inputs["image_token_index"] = torch.arange(int((inputs["input_ids"] == family.image_token_id).sum()))
    return inputs


MIN_TILES = 2
"""Tiles of the microbatch a tile family is exported at (see :func:`dynamic_shapes`)."""


def export_example(inputs: Mapping[str, torch.Tensor], family: Family) -> dict[str, torch.Tensor]:
    """``inputs`` fit to be exported at: a tile family's with at least :data:`MIN_TILES` tiles
    (dummy tiles after the real ones, whose features ``image_token_index`` leaves out)."""
    out = dict(inputs)
    if isinstance(family, PatchStreamFamily) or out["pixel_values"].shape[0] >= MIN_TILES:
        return out
    more = MIN_TILES - out["pixel_values"].shape[0]
    out["pixel_values"] = torch.cat([out["pixel_values"], *[dummy_images(family)["pixel_values"]] * more])
    return out


def dynamic_shapes(example: Mapping[str, torch.Tensor], family: Family) -> dict[str, Any]:
    """``torch.export`` dynamic dimensions of :class:`PackedStep`'s inputs: the vision sizes."""
    from torch.export import Dim

    shapes: dict[str, Any] = dict.fromkeys(example)
    # At most every LLM token (Qwen3-VL's deepstack adds features at the image tokens' places,
    # which export bounds by the tokens there are).
    tokens = example["input_ids"].numel()
    shapes["image_token_index"] = {0: Dim("image_tokens", min=0, max=tokens)}
    if not isinstance(family, PatchStreamFamily):
        # From 2: InternViT's class token is expanded to the tile count, which torch reads as
        # "not 1" even when sizes 0 and 1 are not assumed away. The graph is the same for one
        # tile (an expand to 1 is a view), which the packing tests run.
        shapes["pixel_values"] = {0: Dim("tiles", min=MIN_TILES, max=1 << 16)}
        return shapes
    patches = family.merge**2 * Dim("merged_patches", min=1, max=1 << 20)
    shapes["pixel_values"] = shapes["vision_position_ids"] = {0: patches}
    shapes["image_grid_thw"] = {0: Dim("images", min=1, max=1 << 14)}
    shapes["cu_seqlens"] = {0: Dim("segments_1", min=2, max=1 << 15)}
    if "window_index" in example:
        shapes["window_index"] = {0: Dim("windowed", min=1, max=1 << 20)}
        shapes["cu_window_seqlens"] = {0: Dim("windows_1", min=2, max=1 << 20)}
    if "interp_indices" in example:
        shapes["interp_indices"] = shapes["interp_weights"] = {0: patches}
    return shapes


ImageFeatures = Callable[[nn.Module, Mapping[str, torch.Tensor]], types.SimpleNamespace]
"""``(model, packed inputs) -> encoder output``: what a family's ``get_image_features`` returns,
for the features of the image tokens alone (:func:`encoder_output`)."""


def encoder_output(
    features: torch.Tensor,
    inputs: Mapping[str, torch.Tensor],
    *,
    joined: bool = False,
    deepstack: Sequence[torch.Tensor] | None = None,
) -> types.SimpleNamespace:
    """What a model's own ``get_image_features`` returns, made of ``features`` (one row a
    feature of every image) by keeping the rows ``image_token_index`` picks: a sequence of
    per-image features (joined by the model's forward), or one tensor where the model takes it
    ``joined`` (InternVL); with the features of Qwen3-VL's ``deepstack`` layers, the same rows."""
    pick = inputs["image_token_index"]
    features = features.index_select(0, pick)
    out = types.SimpleNamespace(pooler_output=features if joined else (features,))
    if deepstack is not None:
        out.deepstack_features = [(layer.index_select(0, pick),) for layer in deepstack]
    return out


class PackedStep(nn.Module):
    """The loss of one packed microbatch: the family's image features, the ones ``image_token_index``
    picks placed at the image tokens, and the model's own forward and loss from there (it takes
    precomputed encoder outputs as ``mm_encoder_outputs``)."""

    def __init__(self, inner: nn.Module, family: Family, features: ImageFeatures | None = None):
        super().__init__()
        if features is None and family.name != "zoo":
            raise ModelError(
                f"PackedStep of a {family.name} model needs its family's image_features "
                "(vlmcompile.families.spec_of(model).image_features)"
            )
        self.inner = inner
        self.features = features
        """The family's image features (:attr:`~vlmcompile.families.spec.FamilySpec.image_features`);
        None for the zoo's VLM, which takes packed inputs itself."""

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        num_items_in_batch: torch.Tensor,
        pixel_values: torch.Tensor,
        image_token_index: torch.Tensor,
        image_grid_thw: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        vision_position_ids: torch.Tensor | None = None,
        window_index: torch.Tensor | None = None,
        cu_window_seqlens: torch.Tensor | None = None,
        interp_indices: torch.Tensor | None = None,
        interp_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # Named, not **inputs: torch.export matches dynamic shapes to the parameters' names.
        inputs = {k: v for k, v in locals().items() if isinstance(v, torch.Tensor)}
        if self.features is None:  # the zoo's VLM takes packed inputs itself
            return self.inner(
                pixel_values,
                input_ids,
                labels,
                attention_mask=attention_mask,
                position_ids=position_ids,
                image_token_index=image_token_index,
                num_items_in_batch=num_items_in_batch,
            )
        encoded = self.features(self.inner, inputs)
        out = self.inner(
            input_ids=inputs["input_ids"],
            labels=inputs["labels"],
            attention_mask=inputs["attention_mask"],
            position_ids=inputs["position_ids"],
            num_items_in_batch=inputs["num_items_in_batch"],
            use_cache=False,
            mm_encoder_outputs={"image": encoded},
        )
        return out.loss


def segment_attention(module, query, key, value, attention_mask, cu_seq_lens_q=None, **kwargs):
    """Attention over a packed patch stream in which each segment (``cu_seq_lens_q``: an image,
    or a window of one) attends to itself only: one masked SDPA call instead of one call per
    segment, so no shape depends on the segments' lengths."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    length = query.shape[-2]
    segment = torch.searchsorted(
        cu_seq_lens_q[1:].contiguous(), torch.arange(length, device=query.device), right=True
    )
    mask = (segment[:, None] == segment[None, :])[None, None]
    options = {k: kwargs[k] for k in ("dropout", "scaling") if k in kwargs}
    return sdpa_attention_forward(module, query, key, value, mask, is_causal=False, **options)


@contextlib.contextmanager
def capturable(model: nn.Module, family: Family) -> Iterator[None]:
    """While capturing: Qwen's vision attention runs as :func:`segment_attention`, and sizes of
    0 and 1 are not assumed away (a microbatch may hold one image)."""
    import torch.fx.experimental._config as shape_config

    with shape_config.patch(backed_size_oblivious=True):
        if not isinstance(family, PatchStreamFamily):
            yield
            return
        from transformers import AttentionInterface

        AttentionInterface.register(SEGMENT_ATTENTION, segment_attention)
        vision = model.config.vision_config
        before = vision._attn_implementation
        vision._attn_implementation = SEGMENT_ATTENTION
        try:
            yield
        finally:
            vision._attn_implementation = before


def pack_step(
    samples: Sequence[Mapping[str, Any]],
    family: Family,
    *,
    tokens: int,
    num_microbatches: int,
) -> PackedBatch:
    """One step's samples packed into ``num_microbatches`` microbatches (every data-parallel
    rank's, in rank order) as :class:`PackedStep` takes them; what fits in none is deferred."""
    packing = pack(samples, family, tokens=tokens, num_microbatches=num_microbatches)
    microbatches = tuple(step_inputs(mb, family, packing.label_tokens) for mb in packing.microbatches)
    kept = [i for mb in packing.microbatches for row in mb.samples for i in row]
    images = any(family.vision_rows(samples[i]) for i in kept)
    return PackedBatch(microbatches, len(samples) - len(packing.deferred), packing.deferred, images=images)
