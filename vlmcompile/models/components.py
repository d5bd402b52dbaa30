"""The towers a VLM is assembled from: ViT encoder, projector, decoder LLM, heads.

Each class declares its region through the ``vlmcompile_region`` class attribute, which the
capture pass reads; plain-PyTorch models outside the zoo can do the same.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vlmcompile.models.blocks import DecoderBlock, EncoderBlock, RMSNorm
from vlmcompile.models.configs import (
    ContrastiveConfig,
    LLMConfig,
    ProjectorConfig,
    TextEncoderConfig,
    ViTConfig,
)


class PatchEmbed(nn.Module):
    """Image -> patch tokens (one strided convolution) plus a learned position embedding."""

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.conv = nn.Conv2d(cfg.channels, cfg.width, kernel_size=cfg.patch, stride=cfg.patch)
        self.pos = nn.Parameter(torch.zeros(1, cfg.tokens_per_image, cfg.width))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.conv(images).flatten(2).transpose(1, 2) + self.pos


class ViTEncoder(nn.Module):
    """Vision transformer: patch embedding, pre-norm blocks, final LayerNorm."""

    vlmcompile_region = "vision"

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList(
            EncoderBlock(width=cfg.width, heads=cfg.heads, head_dim=cfg.head_dim, mlp=cfg.mlp)
            for _ in range(cfg.depth)
        )
        self.norm = nn.LayerNorm(cfg.width)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """images (..., channels, px, px); leading dims (batch, images per sample) are merged here,
        inside the encoder, so two encoders reading the same images stay independent branches."""
        x = self.embed(images.flatten(0, -4))
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


class Projector(nn.Module):
    """Image tokens -> LLM width: optional pixel shuffle, LayerNorm, Linear, GELU, Linear.

    Pixel shuffle with factor r merges each r x r patch neighbourhood into one token of r^2
    times the width, so the LLM sees r^2 fewer image tokens (InternVL uses r = 2).
    """

    vlmcompile_region = "projector"

    def __init__(self, cfg: ProjectorConfig, *, vit: ViTConfig, llm_width: int):
        super().__init__()
        self.shuffle, self.grid = cfg.pixel_shuffle, vit.grid
        in_width = vit.width * cfg.pixel_shuffle**2
        hidden = cfg.hidden or llm_width
        self.norm = nn.LayerNorm(in_width)
        self.fc1 = nn.Linear(in_width, hidden)
        self.fc2 = nn.Linear(hidden, llm_width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.shuffle > 1:
            r, g = self.shuffle, self.grid
            width = tokens.shape[-1]
            tokens = tokens.reshape(-1, g // r, r, g // r, r, width).permute(0, 1, 3, 2, 4, 5)
            tokens = tokens.reshape(-1, (g // r) ** 2, r * r * width)
        return self.fc2(F.gelu(self.fc1(self.norm(tokens))))


class TokenEmbedding(nn.Module):
    def __init__(self, vocab: int, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab, width) * 0.02)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class TextEmbed(nn.Module):
    """Token embedding plus a learned position embedding."""

    def __init__(self, vocab: int, width: int, tokens: int):
        super().__init__()
        self.tokens = TokenEmbedding(vocab, width)
        self.pos = nn.Parameter(torch.zeros(1, tokens, width))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(input_ids) + self.pos


class DecoderLM(nn.Module):
    """Decoder-only LLM trunk: token embedding, decoder blocks, final RMSNorm."""

    vlmcompile_region = "llm"

    def __init__(self, cfg: LLMConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = TokenEmbedding(cfg.vocab, cfg.width)
        self.blocks = nn.ModuleList(
            DecoderBlock(
                width=cfg.width,
                heads=cfg.heads,
                kv_heads=cfg.kv_heads,
                head_dim=cfg.head_dim,
                mlp=cfg.mlp,
                gated_mlp=cfg.gated_mlp,
            )
            for _ in range(cfg.depth)
        )
        self.norm = RMSNorm(cfg.width)

    def forward(
        self,
        hidden: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        for block in self.blocks:
            hidden = block(hidden, attention_mask, position_ids)
        return self.norm(hidden)


class LMHead(nn.Module):
    """Output projection over the text positions and the next-token cross-entropy loss."""

    vlmcompile_region = "head"

    def __init__(self, cfg: LLMConfig):
        super().__init__()
        self.proj = nn.Linear(cfg.width, cfg.vocab, bias=False)

    def forward(
        self, hidden: torch.Tensor, labels: torch.Tensor, num_items_in_batch: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The mean over the label tokens; with ``num_items_in_batch`` (packed microbatches), the
        sum over them divided by that count (the step's label tokens)."""
        # Only the last labels.shape[1] positions are text: image tokens come first (in packed
        # microbatches they are placeholders in the text, and the labels cover every position).
        text = hidden[:, hidden.shape[1] - labels.shape[1] :]
        logits = self.proj(text[:, :-1]).flatten(0, 1)
        if num_items_in_batch is None:
            return F.cross_entropy(logits, labels[:, 1:].flatten(), ignore_index=-100)
        total = F.cross_entropy(logits, labels[:, 1:].flatten(), ignore_index=-100, reduction="sum")
        return total / num_items_in_batch


class TextEncoder(nn.Module):
    """Text tower of a contrastive pair: token + position embedding, causal encoder blocks."""

    vlmcompile_region = "text"

    def __init__(self, cfg: TextEncoderConfig):
        super().__init__()
        self.embed = TextEmbed(cfg.vocab, cfg.width, cfg.tokens)
        self.blocks = nn.ModuleList(
            EncoderBlock(width=cfg.width, heads=cfg.heads, head_dim=cfg.head_dim, mlp=cfg.mlp, causal=True)
            for _ in range(cfg.depth)
        )
        self.norm = nn.LayerNorm(cfg.width)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


class ContrastiveHead(nn.Module):
    """CLIP loss (Radford et al. 2021): project both towers, symmetric InfoNCE over the batch."""

    vlmcompile_region = "head"

    def __init__(self, cfg: ContrastiveConfig):
        super().__init__()
        self.image_proj = nn.Linear(cfg.vision.width, cfg.embed_dim, bias=False)
        self.text_proj = nn.Linear(cfg.text.width, cfg.embed_dim, bias=False)
        self.logit_scale = nn.Parameter(torch.tensor(2.659))  # log(1 / 0.07), CLIP's initial temperature

    def forward(self, image_tokens: torch.Tensor, text_tokens: torch.Tensor) -> torch.Tensor:
        image = F.normalize(self.image_proj(image_tokens.mean(1)), dim=-1)
        text = F.normalize(self.text_proj(text_tokens[:, -1]), dim=-1)  # last token, as CLIP's EOT
        logits = self.logit_scale.exp() * image @ text.t()
        targets = torch.arange(logits.shape[0], device=logits.device)
        return (F.cross_entropy(logits, targets) + F.cross_entropy(logits.t(), targets)) / 2
