"""Cost model: collectives, roofline layer times, TP sharding and memory by ZeRO stage."""

import dataclasses

import pytest

from vlmcompile.cost_models import comm
from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.cost_models.compute import REPLICATED_SHARE_WITHOUT_SP, is_tensor_parallel, layer_time
from vlmcompile.cost_models.hardware import Efficiency
from vlmcompile.cost_models.memory import kept_activation_bytes, model_state_bytes
from vlmcompile.cost_models.stage_costs import layer_costs
from vlmcompile.ir.plan import Parallel, Precision, Recompute
from vlmcompile.ir.regions import Region
from vlmcompile.planning.request import PlanRequest

H100 = Cluster.preset("h100x16")


def test_ring_collectives_follow_the_alpha_beta_model():
    n, bw, lat = 8, 100e9, 1e-5
    size = 1e9
    assert comm.reduce_scatter_s(size, n, bw, lat) == pytest.approx(7 / 8 * size / bw + 7 * lat)
    assert comm.all_gather_s(size, n, bw, lat) == comm.reduce_scatter_s(size, n, bw, lat)
    assert comm.all_reduce_s(size, n, bw, lat) == pytest.approx(2 * comm.reduce_scatter_s(size, n, bw, lat))
    assert comm.all_reduce_s(size, 1, bw, lat) == 0
    assert comm.p2p_s(size, bw, lat) == pytest.approx(lat + size / bw)


def test_layer_time_is_the_roofline_sum_and_scales_with_samples_and_tp(demo_graph):
    block = demo_graph["llm.blocks.0"]
    dev = H100.device
    t = layer_time(block, dev)
    eff = dev.efficiency
    expected = (
        (block.fwd_flops - block.fwd_attn_flops) / (dev.peak_flops_per_s * eff.matmul)
        + block.fwd_attn_flops / (dev.peak_flops_per_s * eff.attention)
        + block.fwd_mem_bytes / (dev.mem_bw_bytes_per_s * eff.memory)
    )
    assert t.fwd_s == pytest.approx(expected)
    assert layer_time(block, dev, samples=2).fwd_s == pytest.approx(2 * t.fwd_s)
    assert layer_time(block, dev, tp=2).fwd_s == pytest.approx(t.fwd_s / 2)
    no_sp = layer_time(block, dev, tp=2, sequence_parallel=False).fwd_s
    assert no_sp > t.fwd_s / 2  # norms and residuals run replicated without SP
    # backward: W is one GEMM per weight matrix, I the rest
    assert t.weight_grad_s == pytest.approx(
        (block.fwd_flops - block.fwd_attn_flops) / (dev.peak_flops_per_s * eff.matmul)
    )
    assert t.bwd_s > t.fwd_s


def test_better_efficiency_makes_layers_faster(demo_graph):
    block = demo_graph["encoders.0.blocks.0"]
    slow = dataclasses.replace(H100.device, efficiency=Efficiency(0.3, 0.2, 0.5))
    assert layer_time(block, slow).fwd_s > layer_time(block, H100.device).fwd_s
    with pytest.raises(ValueError, match="matmul efficiency 1.5 is outside"):
        Efficiency(matmul=1.5)


def test_norms_stay_replicated_and_blocks_are_sharded(demo_graph):
    assert is_tensor_parallel(demo_graph["llm.blocks.0"])
    assert is_tensor_parallel(demo_graph["llm.embed"])  # vocab-parallel embedding
    assert not is_tensor_parallel(demo_graph["llm.norm"])


def test_tp_collectives_two_per_block_and_pass(demo_graph):
    costs = {c.name: c for c in layer_costs(demo_graph, H100, Parallel(dp=1, tp=2, pp=1), microbatch_size=1)}
    block, proj, norm = costs["llm.blocks.0"], costs["projectors.0"], costs["llm.norm"]
    assert block.fwd_tp_comm_s > 0 and block.bwd_tp_comm_s == block.fwd_tp_comm_s
    assert norm.fwd_tp_comm_s == 0
    # one all-reduce of the projector's output against two of the block's hidden state
    hidden = 2 * 384 * 384  # bf16 [1, 384, 384]
    bw, lat = H100.group_link(2, 1)
    assert block.fwd_tp_comm_s == pytest.approx(2 * comm.all_reduce_s(hidden, 2, bw, lat))
    assert proj.fwd_tp_comm_s > 0
    serial = layer_costs(demo_graph, H100, Parallel(dp=1, tp=1, pp=1), microbatch_size=1)
    assert all(c.fwd_tp_comm_s == 0 for c in serial)


def test_full_recompute_adds_a_forward_to_the_backward(demo_graph):
    par = Parallel(dp=1, tp=1, pp=1)
    plain = layer_costs(demo_graph, H100, par, microbatch_size=1)
    full = layer_costs(demo_graph, H100, par, microbatch_size=1, recompute={"llm.blocks.0": Recompute.FULL})
    i = [c.name for c in plain].index("llm.blocks.0")
    assert full[i].input_grad_s == pytest.approx(plain[i].input_grad_s + plain[i].fwd_s)
    assert full[i - 1] == plain[i - 1]


@pytest.mark.parametrize(
    ("zero", "expected"), [(0, 2 + 4 + 12), (1, 2 + 4 + 12 / 8), (2, 2 + 4 / 8 + 12 / 8), (3, 18 / 8)]
)
def test_model_states_by_zero_stage(zero, expected):
    assert model_state_bytes(1.0, Precision(), dp=8, zero_stage=zero).total == pytest.approx(expected)


def test_activations_shrink_with_recompute_and_tp(demo_graph):
    block = demo_graph["llm.blocks.0"]
    kw = {"samples": 1.0, "sequence_parallel": True}
    none = kept_activation_bytes(block, Recompute.NONE, tp=1, **kw)
    assert none == block.saved_bytes
    assert kept_activation_bytes(block, Recompute.FULL, tp=1, **kw) == block.saved_bytes_recompute < none
    assert kept_activation_bytes(block, Recompute.NONE, tp=4, **kw) == pytest.approx(none / 4)
    no_sp = kept_activation_bytes(block, Recompute.NONE, tp=4, samples=1.0, sequence_parallel=False)
    assert no_sp == pytest.approx(
        none * (REPLICATED_SHARE_WITHOUT_SP + (1 - REPLICATED_SHARE_WITHOUT_SP) / 4)
    )


def test_plans_for_local_ranks_all_reduce_gradients_as_the_runtime_does(demo_graph):
    # Our runtime (local ranks) has no ZeRO: requests on them plan without it and all-reduce;
    # a GPU cluster's plans use ZeRO-1 and reduce-scatter.
    cpu = Cluster.local_cpu(2)
    local = PlanRequest.on(cpu, tp=1, pp=1, global_batch=2).parallel
    assert local.zero_stage == 0
    assert PlanRequest.on(H100, tp=1, pp=8, global_batch=2).parallel.zero_stage == 1
    block = demo_graph["llm.blocks.0"]
    grads = block.num_params * Precision().dp_grad_bytes
    mine = {c.name: c for c in layer_costs(demo_graph, cpu, local, microbatch_size=1)}["llm.blocks.0"]
    assert mine.dp_reduce_s == pytest.approx(comm.all_reduce_s(grads, 2, *cpu.group_link(2, 1)))
    zero1 = Parallel(dp=2, tp=1, pp=1, zero_stage=1)
    gpu = {c.name: c for c in layer_costs(demo_graph, H100, zero1, microbatch_size=1)}["llm.blocks.0"]
    assert gpu.dp_reduce_s == pytest.approx(comm.reduce_scatter_s(grads, 2, *H100.group_link(2, 1)))


def test_frozen_parameters_have_no_gradient_traffic_nor_optimizer_state(demo_graph):
    """A frozen encoder (LLaVA's recipe) keeps its bf16 weights on the rank, but no fp32
    gradient, no Adam state, and nothing to reduce over data parallel."""
    from vlmcompile.cost_models.stage_costs import layer_state_bytes

    frozen = demo_graph.with_frozen(["vision"])
    cluster = Cluster.preset("h100x8")
    par = Parallel(dp=8, tp=1, pp=1, zero_stage=0)
    live = {c.name: c for c in layer_costs(demo_graph, cluster, par, microbatch_size=1)}
    cold = {c.name: c for c in layer_costs(frozen, cluster, par, microbatch_size=1)}
    precision = Precision()
    for layer in demo_graph.layers:
        a, b = live[layer.name], cold[layer.name]
        if layer.region is Region.VISION and layer.num_params:
            assert b.dp_reduce_s == 0 < a.dp_reduce_s
            assert layer_state_bytes(b, par) == pytest.approx(layer.num_params * precision.param_bytes)
            assert layer_state_bytes(a, par) > layer_state_bytes(b, par)
        else:
            assert (a.dp_reduce_s, layer_state_bytes(a, par)) == (b.dp_reduce_s, layer_state_bytes(b, par))


def test_a_frozen_layer_has_no_weight_gradient_and_no_backward_with_nothing_trainable_before(demo_graph):
    """A frozen vision tower under a trainable projector (LLaVA's second stage): the tower takes no
    weight gradient and, with nothing trainable before it, no input gradient and no recompute;
    a frozen LLM above the trainable projector (LLaVA's first stage) still passes its input
    gradient on, without weight gradients."""
    cluster = Cluster.preset("h100x8")
    par = Parallel(dp=8, tp=2, pp=1)
    full = {layer.name: Recompute.FULL for layer in demo_graph.layers}
    live = {c.name: c for c in layer_costs(demo_graph, cluster, par, microbatch_size=1, recompute=full)}
    for frozen_region in (Region.VISION, Region.LLM):
        graph = demo_graph.with_frozen([frozen_region.value])
        cold = {c.name: c for c in layer_costs(graph, cluster, par, microbatch_size=1, recompute=full)}
        for layer in demo_graph.layers:
            a, b = live[layer.name], cold[layer.name]
            assert b.fwd_s == a.fwd_s and b.fwd_tp_comm_s == a.fwd_tp_comm_s
            if layer.region is not frozen_region:
                # The projector under a frozen tower needs no input gradient either.
                assert b.weight_grad_s == a.weight_grad_s and b.input_grad_s <= a.input_grad_s
                if layer.region is Region.PROJECTOR and frozen_region is Region.VISION:
                    assert b.input_grad_s < a.input_grad_s
            elif frozen_region is Region.VISION:  # the bottom of the graph: no backward at all
                assert b.b_s == 0 < a.b_s
            else:
                assert b.weight_grad_s == 0
                assert b.input_grad_s == pytest.approx(a.input_grad_s)
                assert a.input_grad_s > 0 or not layer.fwd_flops


def test_the_cost_model_splits_a_measured_frozen_backward_as_it_ran():
    """Annotate measures the backward of the model as frozen: a frozen LLM block above a
    trainable projector (LLaVA's first stage) computes its input gradient only, a block with one
    weight matrix trainable that matrix's weight gradient too. The cost model's split of those
    measured backwards matches the trainable model's input gradient and its share of the weight
    gradient, and :meth:`LayerGraph.with_frozen` of the trainable model's graph predicts the
    backward FLOPs annotate measures."""
    from tests.models import build
    from vlmcompile import compile

    model, batch = build("tiny", batch_size=2)
    trained = compile(model, batch, log=None).layer_graph
    model.encoders.requires_grad_(False)
    model.llm.requires_grad_(False)
    block = dict(model.llm.blocks[1].named_parameters())
    block[next(n for n, p in block.items() if p.dim() == 2)].requires_grad_(True)
    measured = compile(model, batch, log=None).layer_graph

    predicted = trained.with_frozen(["vision", "llm.embed", "llm.blocks.0", "llm.norm"])
    assert predicted["llm.blocks.0"].bwd_flops == measured["llm.blocks.0"].bwd_flops
    vision = {layer.name for layer in trained.in_region(Region.VISION)}
    assert predicted.forward_only() == measured.forward_only() == vision
    assert all(measured[n].bwd_flops == predicted[n].bwd_flops == 0 for n in vision)

    cluster = Cluster.preset("h100x8")
    par = Parallel(dp=1, tp=1, pp=1)
    live = {c.name: c for c in layer_costs(trained, cluster, par, microbatch_size=1)}
    cold = {c.name: c for c in layer_costs(measured, cluster, par, microbatch_size=1)}
    frozen_block, partly = cold["llm.blocks.0"], cold["llm.blocks.1"]
    assert frozen_block.weight_grad_s == 0
    # (Its FLOPs are the same; annotate measures less memory traffic in a frozen backward.)
    assert frozen_block.input_grad_s == pytest.approx(live["llm.blocks.0"].input_grad_s, rel=0.15)
    share = measured["llm.blocks.1"].trainable_share
    assert 0 < share < 1
    assert partly.weight_grad_s == pytest.approx(share * live["llm.blocks.1"].weight_grad_s, rel=0.25)
    assert partly.input_grad_s == pytest.approx(live["llm.blocks.1"].input_grad_s, rel=0.15)


@pytest.mark.parametrize("frozen", [False, True])
def test_repeated_blocks_costed_once_cost_what_each_alone_costs(demo_graph, frozen):
    """layer_costs costs each distinct layer once; every layer's cost must still be the one
    layer_cost gives it alone (names, recompute flags and frozen layers included)."""
    from vlmcompile.cost_models.stage_costs import layer_cost, samples_per_microbatch

    graph = demo_graph.with_frozen([demo_graph.layers[0].name.split(".")[0]]) if frozen else demo_graph
    cluster = Cluster.preset("h100x8")
    flags = {layer.name: Recompute.FULL for layer in graph.layers[::3]}
    before = graph.trains_before()
    for par in (Parallel(dp=2, tp=2, pp=2), Parallel(dp=8, tp=1, pp=1)):
        costs = layer_costs(graph, cluster, par, microbatch_size=2, recompute=flags)
        samples = samples_per_microbatch(graph, 2)
        alone = [
            layer_cost(
                layer,
                graph,
                cluster,
                par,
                samples=samples,
                recompute=flags.get(layer.name, Recompute.NONE),
                trains_before=before[layer.name],
            )
            for layer in graph.layers
        ]
        assert costs == alone
        assert len({c.name for c in costs}) == len(graph.layers)
