"""Whole models of the zoo: the generative VLM (one or more encoders) and the contrastive pair."""

from __future__ import annotations

import torch
from torch import nn

from vlmcompile.models.configs import ContrastiveConfig, VLMConfig
from vlmcompile.models.towers import ContrastiveHead, DecoderLM, LMHead, Projector, TextEncoder, ViTEncoder


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

    def forward(
        self, pixel_values: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor
    ) -> torch.Tensor:
        """pixel_values (batch, images, channels, px, px); input_ids and labels (batch, text tokens)."""
        parts = []
        for encoder, projector in zip(self.encoders, self.projectors):
            tokens = projector(encoder(pixel_values))
            parts.append(tokens.reshape(input_ids.shape[0], -1, tokens.shape[-1]))
        parts.append(self.llm.embed(input_ids))
        return self.head(self.llm(torch.cat(parts, dim=1)), labels)


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
