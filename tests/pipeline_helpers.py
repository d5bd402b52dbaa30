"""Hand-made plans for the tiny models, for codegen and runtime tests."""

from __future__ import annotations

import dataclasses

import torch

from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.ir.plan import Plan, Recompute
from vlmcompile.ir.regions import Region
from vlmcompile.planning import encoder_plans as ep
from vlmcompile.planning.build import build_plan, build_separate_plan
from vlmcompile.planning.request import PlanRequest


def even_plan(
    layer_graph,
    *,
    pp: int,
    dp: int = 1,
    v: int = 1,
    microbatch_size: int = 1,
    global_batch: int,
    recompute: tuple[int, ...] = (),
    cuts: list[int] | None = None,
    placement: str = "loop",
    zero_stage: int = 0,
    schedule: str | None = None,
) -> Plan:
    """pp x v stages of about equal layer counts (or cut before the given layer indices), 1F1B or
    interleaved 1F1B (V-shaped 1F1B with ``placement="v"``), full recompute on the layers at the
    ``recompute`` indices."""
    names = [layer.name for layer in layer_graph.layers]
    k = pp * v
    bounds = [0, *(cuts or [i * len(names) // k for i in range(1, k)]), len(names)]
    chunks = [names[a:b] for a, b in zip(bounds, bounds[1:])]
    cluster = Cluster.preset(f"cpu:{pp * dp}")
    request = PlanRequest.on(
        cluster,
        tp=1,
        pp=pp,
        v=v,
        global_batch=global_batch,
        microbatch_size=microbatch_size,
        sequence_parallel=False,
        zero_stage=zero_stage,
        placement=placement,
        schedule=schedule,
    )
    return build_plan(
        layer_graph,
        cluster,
        request,
        policy="test",
        chunks=chunks,
        recompute={names[i]: Recompute.FULL for i in recompute},
        decisions=[],
    )


def encoder_on_rank_1(layer_graph, *, global_batch: int) -> Plan:
    """Two stages: the vision encoder alone on rank 1, the rest (projector, LLM, head) on rank 0."""
    names = [layer.name for layer in layer_graph.layers]
    first_other = next(i for i, layer in enumerate(layer_graph.layers) if layer.region is not Region.VISION)
    plan = even_plan(layer_graph, pp=2, global_batch=global_batch, cuts=[first_other], recompute=(1,))
    assert names[0] in plan.stages[0].layers
    stages = tuple(dataclasses.replace(s, rank=1 - s.rank) for s in plan.stages)
    out = dataclasses.replace(plan, stages=stages, actions=(plan.actions[1], plan.actions[0]))
    out.validate(layer_graph)
    return out


def separate_plan(
    layer_graph,
    *,
    pp: int,
    encoder_pp: int,
    dp: int = 1,
    chunks: int = 1,
    global_batch: int,
    assignment: tuple[int, ...] | None = None,
    recompute: tuple[int, ...] = (),
    zero_stage: int = 0,
) -> Plan:
    """The encoders with a plan of their own (PP ``encoder_pp``, replicated over the rest) beside
    the LLM on ``pp`` ranks in even 1F1B stages; encoder work in phases before and after the LLM's."""
    count = ep.encoder_layer_count(layer_graph)
    names = [layer.name for layer in layer_graph.layers]
    llm_names = names[count:]
    bounds = [i * len(llm_names) // pp for i in range(pp + 1)]
    cluster = Cluster.preset(f"cpu:{pp * dp}")
    request = PlanRequest.on(
        cluster, tp=1, pp=pp, global_batch=global_batch, sequence_parallel=False, zero_stage=zero_stage
    )
    encoder = ep.EncoderPlan(pp=encoder_pp, tp=1, chunks=chunks)
    return build_separate_plan(
        layer_graph,
        cluster,
        request,
        encoder,
        policy="test",
        encoder_pieces=ep.encoder_chunks(layer_graph, encoder, [1.0] * count),
        llm_chunks=[llm_names[a:b] for a, b in zip(bounds, bounds[1:])],
        recompute={names[i]: Recompute.FULL for i in recompute},
        decisions=[],
        assignment=assignment,
    )


def eager_step(model, batch):
    """Eager loss and gradients, under every name of a tied parameter."""
    model.zero_grad()
    out = model(**batch)
    loss = out if isinstance(out, torch.Tensor) else out.loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}


def check_equal_to_eager(model, batch, results):
    """Every rank's loss and every gradient it holds equal eager training of ``model`` on ``batch``."""
    loss_ref, grads_ref = eager_step(model, batch)
    seen = set()
    for rank, result in enumerate(results):
        torch.testing.assert_close(result["loss"], loss_ref, msg=lambda m, r=rank: f"rank {r} loss: {m}")
        for name, grad in result["grads"].items():
            seen.add(name)
            if grads_ref[name] is None:  # frozen or unused: no gradient at all, as in eager
                assert grad is None, f"rank {rank} {name}: eager has no gradient, the pipeline {grad}"
            else:
                torch.testing.assert_close(
                    grad, grads_ref[name], msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}"
                )
    # Every parameter that gets a gradient is on some rank (tied ones under one of their names).
    params = model.named_parameters(remove_duplicate=False)
    covered = {id(p) for n, p in params if n in seen}
    assert {id(p) for p in model.parameters() if p.grad is not None} <= covered


def first_forwards_swapped(plan: Plan) -> Plan:
    """``plan`` with rank 0 running microbatch 1's first forward before microbatch 0's, while the
    next rank still wants microbatch 0 first."""
    first = list(plan.actions[0])
    a, b = (i for i, act in enumerate(first) if act.kind.value == "F" and act.microbatch in (0, 1))
    first[a], first[b] = first[b], first[a]
    return dataclasses.replace(plan, actions=(tuple(first), *plan.actions[1:]))


def run_ahead_plan(layer_graph, *, pp: int = 2, dp: int = 1, global_batch: int, ahead: int) -> Plan:
    """The frozen encoder replicated over ``pp`` ranks beside the LLM's 1F1B stages, scheduled by
    the greedy bubble scheduler with the forwards of the first ``ahead`` microbatches run one
    global batch ahead (``Plan.ahead``)."""
    from vlmcompile.cost_models.stage_costs import plan_costs
    from vlmcompile.passes.planning.bubbles import scheduled_plan
    from vlmcompile.planning.bubble_schedule import greedy, problem_from

    phased = separate_plan(layer_graph, pp=pp, dp=dp, encoder_pp=1, global_batch=global_batch)
    cluster = Cluster.preset(f"cpu:{pp * dp}")
    problem = problem_from(phased, plan_costs(phased, layer_graph, cluster), 2**40)
    problem = dataclasses.replace(problem, ahead=frozenset(range(ahead)))
    plan = scheduled_plan(phased, problem, greedy(problem), {})
    plan.validate(layer_graph)
    return plan


BF16_RTOL = 1e-3
"""bf16 training losses against eager's under the same autocast, relative: a quarter of one unit
of bf16's 8-bit mantissa (2**-8). Both round the same products to bf16, but in other groupings
(microbatches or packed rows against one batch), and AdamW turns the gradients' last-bit
differences into updates of up to the learning rate; a captured graph also keeps in fp32 what
eager under autocast turns back to bf16 (``x.to(input_dtype)`` traced in fp32). Measured over
3 steps, 2026-11-29: at most 6e-5 on the packed families, 2e-4 on the others (Gemma3's first step
4e-5). fp32 eager is as far from bf16 eager after a step, so the losses alone cannot tell the two
apart: :func:`check_bf16_losses` also asks that bf16 ran."""


def check_bf16_losses(got, expected, fp32_first: float, name: str) -> None:
    """Losses of bf16 autocast training equal eager's under ``torch.autocast`` within
    :data:`BF16_RTOL`; the first is not the same pipeline's fp32 loss on that batch (``fp32_first``:
    the pipeline is deterministic, so any difference is autocast's: bf16 ran; Idefics3's first
    losses differ by 5e-7 relative); the weights moved."""
    got, expected = torch.tensor(got), torch.tensor(expected)
    torch.testing.assert_close(got, expected, rtol=BF16_RTOL, atol=0.0, msg=lambda m: f"{name} in bf16: {m}")
    assert float(got[0]) != fp32_first, (name, float(got[0]), fp32_first)
    assert len(set(got.tolist())) == len(got), (name, got)
