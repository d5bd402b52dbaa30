"""Annotate: FLOPs against the cited formulas, saved bytes on fake == real, boundaries, fallbacks."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from tests.models import ALL, ZOO, build, needs_transformers
from vlmcompile import ModelError, models
from vlmcompile.cost_models.flops import (
    attention_fwd_flops,
    cpu_sdpa_flop_mapping,
    decoder_block_fwd_flops,
    vit_block_fwd_flops,
)
from vlmcompile.ir.meta_keys import NODE_COST_META
from vlmcompile.models.configs import LLMConfig, ViTConfig
from vlmcompile.passes.graph.annotate import annotate
from vlmcompile.passes.graph.capture import capture


def _annotate(model, batch, overrides=None, **kw):
    return annotate(capture(model, batch, region_overrides=overrides).gm, batch, **kw)


@pytest.mark.parametrize(
    ("width", "heads", "head_dim", "mlp", "image_px", "patch", "batch"),
    [(32, 2, 16, 64, 16, 4, 2), (48, 3, 16, 192, 24, 4, 3), (64, 4, 32, 96, 28, 7, 1)],
)
def test_vit_block_forward_flops_match_the_formula(width, heads, head_dim, mlp, image_px, patch, batch):
    cfg = ViTConfig(
        name="t",
        width=width,
        depth=2,
        mlp=mlp,
        heads=heads,
        head_dim=head_dim,
        image_px=image_px,
        patch=patch,
    )
    model = models.build(cfg)
    images = torch.randn(batch, 3, image_px, image_px)
    graph = _annotate(model, {"images": images}, {"": "vision"}).layer_graph
    expected = vit_block_fwd_flops(
        batch=batch, tokens=cfg.tokens_per_image, width=width, heads=heads, head_dim=head_dim, mlp=mlp
    )
    attention = attention_fwd_flops(
        batch, heads, cfg.tokens_per_image, cfg.tokens_per_image, head_dim, head_dim
    )
    for block in ("blocks.0", "blocks.1"):
        assert graph[block].fwd_flops == pytest.approx(expected, rel=0.01)
        assert graph[block].bwd_flops == 2 * graph[block].fwd_flops
        assert graph[block].fwd_attn_flops == attention
        assert graph[block].bwd_attn_flops == 2 * attention


@pytest.mark.parametrize(
    ("width", "heads", "kv_heads", "head_dim", "mlp", "gated", "tokens", "batch"),
    [
        (32, 4, 2, 8, 64, True, 12, 2),
        (64, 8, 2, 8, 160, True, 20, 1),
        (48, 6, 6, 8, 96, False, 16, 3),
        (64, 4, 1, 16, 128, True, 9, 2),
    ],
)
def test_gqa_decoder_block_forward_flops_match_the_formula(
    width, heads, kv_heads, head_dim, mlp, gated, tokens, batch
):
    cfg = LLMConfig(
        name="t",
        width=width,
        depth=2,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        mlp=mlp,
        vocab=32,
        gated_mlp=gated,
    )
    model = models.build(cfg)
    hidden = torch.randn(batch, tokens, width, requires_grad=True)
    graph = _annotate(model, {"hidden": hidden}, {"": "llm"}).layer_graph
    expected = decoder_block_fwd_flops(
        batch=batch,
        tokens=tokens,
        width=width,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        mlp=mlp,
        gated_mlp=gated,
    )
    for block in ("blocks.0", "blocks.1"):
        assert graph[block].fwd_flops == pytest.approx(expected, rel=0.01)
        # Every counted op is a matrix product (linear or attention): backward = 2 x forward.
        assert graph[block].bwd_flops == 2 * graph[block].fwd_flops


def test_cpu_sdpa_kernel_is_counted_although_torch_registry_misses_it():
    q, k, v = (torch.randn(2, 4, 16, 8, requires_grad=True) for _ in range(3))
    with FlopCounterMode(display=False) as plain:
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert plain.get_total_flops() == 0  # torch has no formula for the CPU flash kernel
    with FlopCounterMode(display=False, custom_mapping=cpu_sdpa_flop_mapping()) as ours:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        fwd = ours.get_total_flops()
        out.sum().backward()
    assert fwd == attention_fwd_flops(2, 4, 16, 16, 8, 8)
    assert ours.get_total_flops() == 3 * fwd


@pytest.mark.parametrize("name", ALL)
def test_saved_bytes_on_fake_tensors_equal_real_cpu_tensors(name):
    model, batch = build(name)
    gm = capture(model, batch).gm
    fake = annotate(gm, batch).layer_graph
    real = annotate(gm, batch, tensor_mode="real").layer_graph
    assert [layer.name for layer in fake.layers] == [layer.name for layer in real.layers]
    for f, r in zip(fake.layers, real.layers):
        assert f.saved_bytes == pytest.approx(r.saved_bytes, rel=0.01), f.name
        assert f.saved_bytes_recompute == pytest.approx(r.saved_bytes_recompute, rel=0.01), f.name
        assert (f.fwd_flops, f.bwd_flops) == (r.fwd_flops, r.bwd_flops), f.name
    assert fake.totals()["saved_bytes"] > 0


@pytest.mark.parametrize("name", ZOO)
def test_figures_of_a_model_built_on_meta_equal_real_cpu_measurements(name):
    meta_model = models.build(name, device="meta")
    meta_batch = models.sample_batch(name, batch_size=2, device="meta")
    on_meta = _annotate(meta_model, meta_batch).layer_graph
    model, batch = build(name)
    real = annotate(capture(model, batch).gm, batch, tensor_mode="real").layer_graph
    for m, r in zip(on_meta.layers, real.layers, strict=True):
        assert m.name == r.name
        assert m.saved_bytes == pytest.approx(r.saved_bytes, rel=0.01), m.name
        assert m.saved_bytes_recompute == pytest.approx(r.saved_bytes_recompute, rel=0.01), m.name
        assert (m.fwd_flops, m.bwd_flops, m.param_bytes) == (r.fwd_flops, r.bwd_flops, r.param_bytes), m.name


def test_recompute_keeps_less_than_it_saves_and_params_are_counted_once():
    model, batch = build("tiny-tied")
    graph = _annotate(model, batch).layer_graph
    for layer in graph.layers:
        if ".blocks." in layer.name:
            assert 0 < layer.saved_bytes_recompute < layer.saved_bytes
    assert graph.totals()["num_params"] == sum(p.numel() for p in model.parameters())
    assert graph["head"].num_params == 0  # the tied weight belongs to llm.embed, which reads it first


def test_boundary_bytes_are_the_hidden_state_and_its_gradient():
    model, batch = build("tiny", batch_size=3)
    graph = _annotate(model, batch).layer_graph
    cfg = models.config("tiny")
    hidden = 3 * cfg.llm_tokens * cfg.llm.width * 4
    assert graph["llm.blocks.0"].boundary_fwd_bytes == hidden
    assert graph["llm.blocks.0"].boundary_bwd_bytes == hidden
    assert graph.layers[-1].boundary_fwd_bytes == 0
    # A cut between the embedding and the first block carries the image tokens and the text embeddings.
    assert graph["llm.embed"].boundary_fwd_bytes == hidden


def test_two_encoder_branches_meet_only_at_the_llm():
    model, batch = build("tiny-two-encoder")
    graph = _annotate(model, batch).layer_graph.graph
    enc0 = {n for n in graph if n.startswith("encoders.0") or n == "projectors.0"}
    enc1 = {n for n in graph if n.startswith("encoders.1") or n == "projectors.1"}
    assert not any((a in enc0 and b in enc1) or (a in enc1 and b in enc0) for a, b in graph.edges)
    assert graph.has_edge("projectors.0", "llm.blocks.0") and graph.has_edge("projectors.1", "llm.blocks.0")


def test_node_costs_sum_to_layer_costs_and_user_parameters_get_no_gradient():
    model, batch = build("tiny")
    result = _annotate(model, batch)
    nodes = [n for n in result.gm.graph.nodes if NODE_COST_META in n.meta]
    assert sum(n.meta[NODE_COST_META].fwd_flops for n in nodes) == result.layer_graph.totals()["fwd_flops"]
    assert sum(n.meta[NODE_COST_META].bwd_flops for n in nodes) == result.layer_graph.totals()["bwd_flops"]
    totals = result.layer_graph.totals()
    assert sum(n.meta[NODE_COST_META].fwd_mem_bytes for n in nodes) == totals["fwd_mem_bytes"] > 0
    assert (
        sum(n.meta[NODE_COST_META].param_bytes for n in nodes) == result.layer_graph.totals()["param_bytes"]
    )
    assert all(p.grad is None for p in model.parameters())


class _Norms(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.vision = nn.LayerNorm(width)
        self.llm = nn.Linear(width, 1, bias=False)

    def forward(self, x):
        return self.llm(self.vision(x)).sum()


def test_memory_traffic_counts_what_flop_free_ops_read_and_write():
    tokens, width = 6, 16
    x = torch.randn(tokens, width)
    graph = _annotate(_Norms(width), {"x": x}).layer_graph
    norm = graph["vision"]
    assert norm.fwd_flops == 0 and norm.fwd_attn_flops == 0
    # native_layer_norm reads x, weight, bias and writes y, mean, rstd
    hidden = tokens * width * 4
    expected = 2 * hidden + 2 * width * 4 + 2 * tokens * 4
    assert norm.fwd_mem_bytes == expected
    assert norm.bwd_mem_bytes > norm.fwd_mem_bytes  # its backward reads more than it writes
    assert graph["llm"].fwd_flops == 2 * tokens * width and graph["llm"].fwd_attn_flops == 0


class _Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.vision = nn.Linear(4, 4)
        self.llm = nn.Linear(4, 1)

    def forward(self, x):
        kept = x[x.sum(-1) > 0]  # data-dependent output shape
        return self.llm(self.vision(kept)).mean()


def test_data_dependent_shapes_fall_back_to_real_tensors_or_say_why_not():
    x = torch.randn(6, 4)
    x[0] = 1.0
    result = _annotate(_Masked(), {"x": x}, {"vision": "vision", "llm": "llm"})
    assert result.report.tensor_mode == "real"
    assert "data-dependent operation at node getitem" in result.report.fallback
    with torch.device("meta"):
        meta_model = _Masked()
    with pytest.raises(ModelError, match="fake tensors cannot follow the data-dependent operation at"):
        _annotate(meta_model, {"x": torch.empty(6, 4, device="meta")}, {"vision": "vision", "llm": "llm"})


@needs_transformers
@pytest.mark.hf
@needs_transformers
@pytest.mark.hf
def test_shapes_that_depend_on_input_values_are_followed_on_fake_tensors():
    # Idefics3 drops all-zero images (a boolean index on the pixels' values) and scatters the
    # image features into the image tokens (masked_scatter: its backward selects by the mask).
    model, batch = build("hf-idefics3")
    fake = _annotate(model, batch).report
    real = annotate(capture(model, batch).gm, batch, tensor_mode="real").report
    assert fake.tensor_mode == "fake" and fake.fallback is None and fake.assumptions == ()
    for f, r in zip(fake.layer_graph.layers, real.layer_graph.layers):
        assert (f.name, f.fwd_flops, f.bwd_flops, f.saved_bytes) == (
            r.name,
            r.fwd_flops,
            r.bwd_flops,
            r.saved_bytes,
        )


@needs_transformers
@pytest.mark.hf
def test_meta_pixels_are_taken_as_ones_and_the_report_says_so():
    from vlmcompile import families

    model, batch = families.build_tiny("idefics3", device="meta")
    assert batch["pixel_values"].device.type == "meta" and batch["input_ids"].device.type == "cpu"
    report = _annotate(model, batch).report
    assert report.assumptions == (
        "meta batch inputs ['pixel_values'] are taken as ones where their values decide shapes",
    )
    real = _annotate(*build("hf-idefics3")).layer_graph
    assert [layer.fwd_flops for layer in report.layer_graph.layers] == [
        layer.fwd_flops for layer in real.layers
    ]


@needs_transformers
@pytest.mark.hf
def test_a_shape_from_meta_token_ids_names_the_input_to_give():
    from vlmcompile import families

    model, batch = families.build_tiny("qwen3-vl", device="meta")
    batch = {**batch, "input_ids": batch["input_ids"].to("meta")}  # which tokens are image tokens: unknown
    with pytest.raises(
        ModelError, match=r"depends on the values of batch inputs \['input_ids'\], which are meta"
    ):
        _annotate(model, batch)


def test_annotate_rejects_a_graph_that_was_not_captured():
    gm = torch.fx.symbolic_trace(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="capture pass"):
        annotate(gm, {"input": torch.randn(1, 2)})


def _same_figures(shared, every):
    """Every layer's and every node's figures alike, measured with repeats shared and without."""
    assert shared.layer_graph == every.layer_graph
    nodes = [(n.name, n.meta.get(NODE_COST_META)) for n in shared.gm.graph.nodes]
    assert nodes == [(n.name, n.meta.get(NODE_COST_META)) for n in every.gm.graph.nodes]


@pytest.mark.parametrize("name", ZOO)
def test_a_layer_that_repeats_an_earlier_one_takes_its_backward_figures(name):
    model, batch = build(name)
    shared = _annotate(model, batch)
    every = _annotate(model, batch, every_layer=True)
    _same_figures(shared, every)
    blocks = sum(".blocks." in layer.name for layer in shared.layer_graph.layers)
    # Each tower's first block reads what no block made (its own inputs); the others repeat it.
    assert 0 < shared.report.repeated_backwards < blocks
    assert every.report.repeated_backwards == every.report.replayed_forwards == 0
    assert 0 < shared.report.replayed_forwards <= shared.report.repeated_backwards
    assert "the other layers repeat one of them exactly" in str(shared.report)


class _Blocks(nn.Module):
    """Blocks with the same parameter shapes that run different ops (heads split otherwise,
    causal or not), one block run twice, a frozen one."""

    def __init__(self, width: int = 32):
        super().__init__()
        from vlmcompile.models.blocks import EncoderBlock

        kinds = [(2, 16, False)] * 2 + [(4, 8, False), (2, 16, True)] + [(2, 16, False)] * 3
        self.vision = nn.ModuleList(
            EncoderBlock(width=width, heads=h, head_dim=d, mlp=2 * width, causal=c) for h, d, c in kinds
        )
        self.vision[6].requires_grad_(False)
        self.llm = nn.Linear(width, 1)

    def forward(self, x):
        for i, block in enumerate(self.vision):
            x = block(x)
            if i == 1:
                x = self.vision[1](x)  # the same module again: its gradient accumulates
        return self.llm(x).square().mean()


def test_layers_that_differ_in_ops_or_share_parameters_are_measured_apart():
    model = _Blocks()
    batch = {"x": torch.randn(2, 6, 32)}
    for on_meta in (False, True):
        m, b = (model.to("meta"), {"x": batch["x"].to("meta")}) if on_meta else (model, batch)
        shared = _annotate(m, b)
        every = _annotate(m, b, every_layer=True)
        _same_figures(shared, every)
        # 5 repeats 4; 0 reads the input, 1 runs twice, 2 splits four heads, 3 is causal and 6
        # frozen: each is its own.
        assert shared.report.repeated_backwards == 1, [layer.name for layer in shared.layer_graph.layers]


@needs_transformers
@pytest.mark.hf
@pytest.mark.parametrize(
    ("name", "repeats"),
    # The tiny Qwen2-VL's and Mllama's two layers a tower differ: Qwen2-VL's first block saves the
    # rotary tables both read and its first text layer holds the mask constant; Mllama's first
    # vision layer takes the tiles in another shape.
    [("hf-gemma3", True), ("hf-qwen2-vl", False), ("hf-mllama", False), ("hf-llava", True)],
)
def test_transformers_layers_that_repeat_take_the_figures_of_the_first(name, repeats):
    from vlmcompile import families

    model, batch = families.build_tiny_by_name(name, device="meta")
    shared = _annotate(model, batch)
    _same_figures(shared, _annotate(model, batch, every_layer=True))
    assert (shared.report.repeated_backwards > 0) == repeats


class _Gate(nn.Module):
    def __init__(self, width: int, scale: torch.Tensor, exp: bool):
        super().__init__()
        self.exp = exp
        self.norm = nn.LayerNorm(width)  # a norm and a linear: a block, one call
        self.linear = nn.Linear(width, width)
        self.register_buffer("scale", scale)  # one tensor, every gate's

    def forward(self, x):
        y = self.linear(self.norm(x)) * self.scale  # the norm keeps its input
        return torch.exp(y) if self.exp else y  # exp keeps its own output


class _Gates(nn.Module):
    """Blocks that save their own output (an exp's backward reads it), a buffer they all hold, and
    a head that reads a block's input again: what a replayed block saves, and what is saved
    after it, depends on what was saved before."""

    def __init__(self, width: int = 16):
        super().__init__()
        scale = torch.full((width,), 0.5)
        self.vision = nn.ModuleList(_Gate(width, scale, exp=i >= 3) for i in range(6))
        self.llm = nn.Linear(width, 1)

    def forward(self, x):
        x, skip = x * 1.0, None
        for i, block in enumerate(self.vision):
            skip = x if i == 2 else skip
            x = block(x)
        # block 2's input again (block 2 replays block 1), saved by the head after block 2 saved it
        return self.llm(x).square().mean() + self.llm(skip).mean()


def test_replayed_blocks_save_what_their_measured_forward_would():
    model, batch = _Gates().to("meta"), {"x": torch.empty(3, 5, 16, device="meta")}
    shared = _annotate(model, batch, overrides={"vision": "vision", "llm": "llm"})
    every = _annotate(model, batch, overrides={"vision": "vision", "llm": "llm"}, every_layer=True)
    _same_figures(shared, every)
    assert shared.report.replayed_forwards > 0
