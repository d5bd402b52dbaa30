"""Transformer building blocks of the reference zoo, in plain PyTorch.

Two block kinds cover every model in the zoo:

* :class:`EncoderBlock` - pre-norm LayerNorm, multi-head attention (one fused qkv matmul),
  GELU MLP. ViTs (Dosovitskiy et al. 2021) and the text towers of CLIP-style pairs.
* :class:`DecoderBlock` - RMSNorm, grouped-query attention with rotary position embedding
  (RoPE), and either a gated SiLU MLP (Llama) or a GELU MLP (GPT-3).

Each block is a self-contained pipeline unit: its only activation input and output is the
hidden state, so a stage cut between two blocks sends exactly one tensor. That is why the
decoder block computes its own rotary tables instead of receiving them from the model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019), as in Llama."""

    def __init__(self, width: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class EncoderBlock(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, *, width: int, heads: int, head_dim: int, mlp: int, causal: bool = False):
        super().__init__()
        self.heads, self.head_dim, self.causal = heads, head_dim, causal
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * heads * head_dim)
        self.proj = nn.Linear(heads * head_dim, width)
        self.norm2 = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, mlp)
        self.fc2 = nn.Linear(mlp, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, _ = x.shape
        qkv = self.qkv(self.norm1(x)).reshape(batch, tokens, 3, self.heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, tokens, -1))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class DecoderBlock(nn.Module):
    """Llama-style decoder block: RMSNorm, GQA with RoPE (Su et al. 2021), gated or GELU MLP."""

    def __init__(
        self,
        *,
        width: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        mlp: int,
        gated_mlp: bool = True,
        rope_theta: float = 10000.0,
    ):
        super().__init__()
        if heads % kv_heads:
            raise ValueError(
                f"heads={heads} is not a multiple of kv_heads={kv_heads}; choose kv_heads dividing heads"
            )
        self.heads, self.kv_heads, self.head_dim, self.gated_mlp = heads, kv_heads, head_dim, gated_mlp
        self.attn_norm = RMSNorm(width)
        self.q_proj = nn.Linear(width, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(width, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(width, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, width, bias=False)
        self.mlp_norm = RMSNorm(width)
        if gated_mlp:
            self.gate_proj = nn.Linear(width, mlp, bias=False)
        self.up_proj = nn.Linear(width, mlp, bias=False)
        self.down_proj = nn.Linear(mlp, width, bias=False)
        inv_freq = 1.0 / rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return x * cos + _rotate_half(x) * sin

    def forward(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``attention_mask`` (batch, 1, tokens, tokens), True where a query may attend to a key,
        and ``position_ids`` (batch, tokens): packed samples (both batch inputs, read by every
        stage); without them, causal attention over positions 0, 1, ..."""
        batch, tokens, _ = x.shape
        h = self.attn_norm(x)
        q = self.q_proj(h).view(batch, tokens, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(batch, tokens, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(batch, tokens, self.kv_heads, self.head_dim).transpose(1, 2)
        if position_ids is None:
            angles = torch.outer(torch.arange(tokens, device=x.device, dtype=torch.float32), self.inv_freq)
        else:  # (batch, 1, tokens, head_dim / 2): broadcast over the heads
            angles = (position_ids[:, None, :, None].float() * self.inv_freq).to(x.device)
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        gqa = self.kv_heads != self.heads
        if attention_mask is None:
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, enable_gqa=gqa)
        x = x + self.o_proj(attn.transpose(1, 2).reshape(batch, tokens, -1))
        h = self.mlp_norm(x)
        if self.gated_mlp:
            return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))
        return x + self.down_proj(F.gelu(self.up_proj(h)))
