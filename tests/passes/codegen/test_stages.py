"""Codegen: the stage modules, run one after another in one process, equal eager."""

from __future__ import annotations

import pytest
import torch

from tests.models import ALL, build
from tests.pipeline_helpers import eager_step, even_plan
from vlmcompile.ir.errors import PlanError
from vlmcompile.ir.plan import Recompute
from vlmcompile.passes.codegen.stages import codegen
from vlmcompile.passes.graph.annotate import annotate
from vlmcompile.passes.graph.capture import capture
from vlmcompile.runtime.stage import load_original_state


def _compiled(name):
    model, batch = build(name)
    gm = capture(model, batch).gm
    return model, batch, gm, annotate(gm, batch).layer_graph


def _canonical(model) -> dict[str, str]:
    """Every parameter name -> the first name of the same tensor (tied weights share one)."""
    first: dict[int, str] = {}
    return {n: first.setdefault(id(p), n) for n, p in model.named_parameters(remove_duplicate=False)}


def _run_chain(stages, batch):
    """Forward through the chain with a detached leaf at every cut, then backward stage by stage."""
    received, saved = (), []
    for stage in stages:
        leaves = tuple(
            x.detach().requires_grad_(x.is_floating_point()) if isinstance(x, torch.Tensor) else x
            for x in received
        )
        out = stage(leaves, batch)
        saved.append((leaves, out))
        received = out if isinstance(out, tuple) else ()
    loss = saved[-1][1]
    loss.backward()
    for k in range(len(stages) - 2, -1, -1):
        _, out = saved[k]
        leaves_next = saved[k + 1][0]
        pairs = [
            (o, g.grad)
            for o, g in zip(out, leaves_next)
            if isinstance(o, torch.Tensor) and o.requires_grad and g.grad is not None
        ]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    return loss.detach()


@pytest.mark.parametrize("name", [n for n in ALL if "contrastive" not in str(n)])
def test_stage_chain_equals_eager_with_recompute(name):
    model, batch, gm, graph = _compiled(name)
    n = len(graph.layers)
    plan = even_plan(graph, pp=3, global_batch=1, recompute=(1, n - 2))
    result = codegen(gm, plan)
    loss_ref, grads_ref = eager_step(model, batch)
    model.zero_grad()
    loss = _run_chain(result.stages, batch)
    torch.testing.assert_close(loss, loss_ref)
    checked, canonical = set(), _canonical(model)
    for stage in result.stages:
        own = dict(stage.named_parameters())
        for name_in_stage, original in stage.original_names().items():
            if name_in_stage in own and grads_ref[original] is not None:
                torch.testing.assert_close(own[name_in_stage].grad, grads_ref[original])
                checked.add(canonical[original])
    assert checked == {canonical[n] for n, g in grads_ref.items() if g is not None}
    assert sum(s.recomputed for s in result.report.stages) == 2
    assert "stage" in str(result.report)


def test_every_parameter_maps_to_the_original_and_loads_back():
    model, batch, gm, graph = _compiled("tiny-two-encoder")
    plan = even_plan(graph, pp=2, global_batch=1)
    stages = codegen(gm, plan).stages
    originals = [o for s in stages for o in s.original_names().values()]
    assert sorted(originals) == sorted([n for n, _ in [*model.named_parameters(), *model.named_buffers()]])
    fresh = {k: torch.randn_like(v) if v.is_floating_point() else v for k, v in model.state_dict().items()}
    for stage in stages:
        load_original_state(stage, fresh)
        own = dict([*stage.named_parameters(), *stage.named_buffers()])
        for name, original in stage.original_names().items():
            if original in fresh:  # non-persistent buffers are in no state dict
                torch.testing.assert_close(own[name], fresh[original])


def test_only_what_later_stages_read_crosses_a_cut():
    _, _, gm, graph = _compiled("tiny")
    stages = codegen(gm, even_plan(graph, pp=3, global_batch=1)).stages
    for a, b in zip(stages, stages[1:]):
        assert a.send == b.receive
    assert stages[0].receive == () and stages[-1].send == ()
    assert "input_ids" not in stages[1].receive  # batch inputs are read locally


def test_plans_for_other_layers_and_selective_recompute_are_refused():
    _, _, gm, graph = _compiled("tiny")
    _, _, _, other = _compiled("tiny-two-encoder")
    with pytest.raises(PlanError, match="do not hold the captured graph's layers"):
        codegen(gm, even_plan(other, pp=2, global_batch=1))
    plan = even_plan(graph, pp=2, global_batch=1)
    selective = type(plan)(
        **{
            **{f: getattr(plan, f) for f in plan.__dataclass_fields__},
            "recompute": {graph.layers[2].name: Recompute.SELECTIVE},
        }
    )
    with pytest.raises(PlanError, match="selective recompute"):
        codegen(gm, selective)
