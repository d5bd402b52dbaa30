"""Whole models of the zoo: the generative VLM (one or more encoders) and the contrastive pair."""

from __future__ import annotations

import torch
from torch import nn

from vlmcompile.models.components import (
    ContrastiveHead,
    DecoderLM,
    LMHead,
    Projector,
    TextEncoder,
    ViTEncoder,
)
from vlmcompile.models.configs import ContrastiveConfig, VLMConfig


class VLM(nn.Module):
    """LLaVA-style VLM: each encoder + projector turns every image into LLM tokens, which come
    before the text tokens; the loss is next-token cross-entropy over the text positions."""

    def __init__(self, cfg: VLMConfig):
        super().__init__()
        self.cfg = cfg
        self.encoders = nn.ModuleList(ViTEncoder(e) for e in cfg.encoders)
        self.projectors = nn.ModuleList(
            Projector(p, vit=e, llm_width=cfg.llm.width) for e, p in zip(cfg.encoders, cfg.projectors)
        )
        self.llm = DecoderLM(cfg.llm)
        self.head = LMHead(cfg.llm)
        if cfg.llm.tie_embeddings:
            self.head.proj.weight = self.llm.embed.weight

    @property
    def image_token_id(self) -> int:
        """The placeholder of an image token in packed samples (the vocabulary's last id)."""
        return self.cfg.llm.vocab - 1

    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(images, tokens, width): each image's tokens, every encoder's in order (the pixels in
        the encoders' dtype: data comes as fp32, a model may be bf16)."""
        pixel_values = pixel_values.to(self.encoders[0].embed.conv.weight.dtype)
        return torch.cat(self._projected(pixel_values), dim=1)

    def _projected(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        """Each encoder's projected tokens. Every encoder runs before any projector, so the
        captured layer order keeps the towers together: frozen towers under trainable projectors
        are then a prefix no gradient reaches (forwards only, and may run a batch ahead)."""
        features = [encoder(pixel_values) for encoder in self.encoders]
        return [projector(f) for projector, f in zip(self.projectors, features)]

    def forward(
        self,
        pixel_values: torch.Tensor,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        image_token_index: torch.Tensor | None = None,
        num_items_in_batch: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """pixel_values (batch, images, channels, px, px); input_ids and labels (batch, text tokens).

        Samples of any image count (:mod:`vlmcompile.data`): pixel_values (images, channels, px,
        px), each image's tokens at :attr:`image_token_id` placeholders of input_ids, filled
        with the features ``image_token_index`` picks (all, in order, by default), an
        ``attention_mask`` of 0/1 per token (right padding) or a 4-D boolean one (packed), and
        ``position_ids``."""
        if attention_mask is not None or image_token_index is not None:
            return self._placeholder_forward(
                pixel_values,
                input_ids,
                labels,
                attention_mask,
                position_ids,
                image_token_index,
                num_items_in_batch,
            )
        parts = [t.reshape(input_ids.shape[0], -1, t.shape[-1]) for t in self._projected(pixel_values)]
        parts.append(self.llm.embed(input_ids))
        return self.head(self.llm(torch.cat(parts, dim=1)), labels)

    def _placeholder_forward(
        self,
        pixel_values,
        input_ids,
        labels,
        attention_mask,
        position_ids,
        image_token_index,
        num_items_in_batch,
    ) -> torch.Tensor:
        embeds = self.llm.embed(input_ids)
        if pixel_values is not None and pixel_values.numel():
            features = self.image_features(pixel_values).flatten(0, 1)
            if image_token_index is not None:
                features = features.index_select(0, image_token_index)
            placeholder = (input_ids == self.image_token_id)[..., None]
            embeds = embeds.masked_scatter(placeholder, features.to(embeds.dtype))
        if (
            attention_mask is not None and attention_mask.dim() == 2
        ):  # right padding: causal over the real tokens
            tokens = input_ids.shape[1]
            causal = torch.ones(tokens, tokens, dtype=torch.bool, device=input_ids.device).tril()
            keys = attention_mask.bool()[:, None, None, :]
            attention_mask = (causal & keys) | torch.eye(tokens, dtype=torch.bool, device=input_ids.device)
        return self.head(self.llm(embeds, attention_mask, position_ids), labels, num_items_in_batch)


class ContrastivePair(nn.Module):
    """CLIP-style pair: image tower and text tower meet only in the contrastive loss."""

    def __init__(self, cfg: ContrastiveConfig):
        super().__init__()
        self.cfg = cfg
        self.vision = ViTEncoder(cfg.vision)
        self.text = TextEncoder(cfg.text)
        self.head = ContrastiveHead(cfg)

    def forward(self, pixel_values: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """pixel_values (batch, channels, px, px); input_ids (batch, text tokens)."""
        return self.head(self.vision(pixel_values), self.text(input_ids))
