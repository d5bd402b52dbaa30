"""Analytic FLOP counts (a multiply-add is 2 FLOPs), and the SDPA formulas torch's counter lacks.

Conventions follow ``torch.utils.flop_counter``, which the annotate pass uses for measured
counts: only matrix products, convolutions and attention are counted (norms, activations,
softmax and RoPE are left out, as in Kaplan et al. 2020, Table 1); attention counts the full
s_q x s_k score matrix even when causal, as Megatron-LM's MFU formula does (Narayanan et al.
2021, eq. 3, before its causal halving); the attention backward is 2x its forward (the four
matrix products dV, dP, dQ, dK - the QK^T that flash kernels recompute is not counted, as in
torch's ``sdpa_backward_flop_count``).
"""

from __future__ import annotations

import torch


def attention_fwd_flops(
    batch: int, q_heads: int, q_tokens: int, kv_tokens: int, qk_dim: int, v_dim: int
) -> int:
    """Scores Q K^T and the weighted sum P V: 2 b h s_q s_k (d_qk + d_v). Key/value heads
    shared by several query heads (GQA) are broadcast, so FLOPs follow the query heads."""
    return 2 * batch * q_heads * q_tokens * kv_tokens * (qk_dim + v_dim)


def _sdpa_shapes_fwd(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    b, h, s_q, d_qk = query_shape
    s_k, d_v = key_shape[2], value_shape[3]
    return attention_fwd_flops(b, h, s_q, s_k, d_qk, d_v)


def _sdpa_shapes_bwd(
    grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs
) -> int:
    return 2 * _sdpa_shapes_fwd(query_shape, key_shape, value_shape)


def cpu_sdpa_flop_mapping() -> dict:
    """``FlopCounterMode(custom_mapping=...)`` entries (functions of shapes) for the CPU flash-attention kernels, which
    torch's FLOP registry does not cover (so SDPA on CPU would count as 0 FLOPs). Keyed by
    op packet, as FlopCounterMode looks ops up by packet, not by overload."""
    aten = torch.ops.aten
    return {
        aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_shapes_fwd,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_shapes_bwd,
    }


def vit_block_fwd_flops(*, batch: int, tokens: int, width: int, heads: int, head_dim: int, mlp: int) -> int:
    """One pre-norm encoder block (fused qkv, output projection, 2-matrix MLP) on ``batch``
    sequences of ``tokens``: 2 T (3 d hd_all + hd_all d + 2 d m) + attention, with T = b s and
    hd_all = heads x head_dim (Kaplan et al. 2020, Table 1; Narayanan et al. 2021, sec. 5.1)."""
    inner = heads * head_dim
    total_tokens = batch * tokens
    dense = 2 * total_tokens * (3 * width * inner + inner * width + 2 * width * mlp)
    return dense + attention_fwd_flops(batch, heads, tokens, tokens, head_dim, head_dim)


def decoder_block_fwd_flops(
    *,
    batch: int,
    tokens: int,
    width: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    mlp: int,
    gated_mlp: bool = True,
) -> int:
    """One decoder block with grouped-query attention (k and v projections of kv_heads x
    head_dim, Ainslie et al. 2023) and a gated MLP of 3 matrices (Shazeer 2020) or 2 without
    gating: 2 T (d hd_q + 2 d hd_kv + hd_q d + n_mlp d m) + attention."""
    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    mlp_mats = 3 if gated_mlp else 2
    total_tokens = batch * tokens
    dense = 2 * total_tokens * (width * q_dim + 2 * width * kv_dim + q_dim * width + mlp_mats * width * mlp)
    return dense + attention_fwd_flops(batch, heads, tokens, tokens, head_dim, head_dim)
