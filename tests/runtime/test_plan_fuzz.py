"""Mutated plan files: each is refused with a PlanError before a rank starts, or runs and trains
equal to eager - never a hang, a crash or a wrong gradient."""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.models import build
from tests.pipeline_helpers import check_equal_to_eager, even_plan
from vlmcompile import compile
from vlmcompile.ir.errors import PlanError, VlmCompileError
from vlmcompile.ir.plan import Plan
from vlmcompile.runtime.executor import BatchError
from vlmcompile.runtime.launch import launch
from vlmcompile.runtime.timed_steps import one_step

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(600)]

NUM_MUTANTS = 100
ODD_VALUES = [0, -1, 1, 2, 3, 7, 500, 2**40, 1.5, "2", None, True, [], {}, "0F0"]


def _actions(data, draw):
    acts = data["actions"]
    rank = draw(st.integers(0, len(acts) - 1))
    return acts, rank


@st.composite
def mutation(draw, data):
    """One random mutation of ``data`` (a plan's JSON, modified in place), or none where an earlier
    mutation broke what this one needs; returns its name."""
    try:
        return _mutate(draw, data)
    except (KeyError, TypeError, AttributeError, IndexError, ValueError, ZeroDivisionError):
        return "not applicable"


def _mutate(draw, data):
    """Apply one random mutation to ``data`` (a plan's JSON, modified in place); returns its name."""
    kind = draw(
        st.sampled_from(
            [
                "delete_action",
                "duplicate_action",
                "swap_in_rank",
                "swap_across_ranks",
                "swap_rank_lists",
                "move_stage_rank",
                "move_layer",
                "number",
                "type",
                "drop_field",
                "recompute",
                "rename_layer",
                # mutations that keep a plan valid, so that the runtime is fuzzed too
                "reorder_forwards",
                "reorder_forwards",
                "move_layer",
                "recompute",
            ]
        )
    )
    acts, rank = _actions(data, draw)
    if kind == "delete_action" and acts[rank]:
        del acts[rank][draw(st.integers(0, len(acts[rank]) - 1))]
    elif kind == "duplicate_action" and acts[rank]:
        i = draw(st.integers(0, len(acts[rank]) - 1))
        acts[rank].insert(draw(st.integers(0, len(acts[rank]))), acts[rank][i])
    elif kind == "swap_in_rank" and len(acts[rank]) > 1:
        i, j = draw(st.lists(st.integers(0, len(acts[rank]) - 1), min_size=2, max_size=2, unique=True))
        acts[rank][i], acts[rank][j] = acts[rank][j], acts[rank][i]
    elif kind == "swap_across_ranks" and len(acts) > 1:
        other = (rank + 1) % len(acts)
        i = draw(st.integers(0, len(acts[rank]) - 1))
        j = draw(st.integers(0, len(acts[other]) - 1))
        acts[rank][i], acts[other][j] = acts[other][j], acts[rank][i]
    elif kind == "swap_rank_lists" and len(acts) > 1:
        acts[0], acts[1] = acts[1], acts[0]
    elif kind == "move_stage_rank":
        stage = draw(st.sampled_from(data["stages"]))
        stage["rank"] = draw(st.integers(-1, len(acts)))
    elif kind == "move_layer":
        i = draw(st.integers(0, len(data["stages"]) - 2))
        left, right = data["stages"][i]["layers"], data["stages"][i + 1]["layers"]
        if draw(st.booleans()) and len(left) > 1:
            right.insert(0, left.pop())
        elif len(right) > 1:
            left.append(right.pop(0))
    elif kind == "number":
        target = draw(
            st.sampled_from(
                [
                    (data, "microbatch_size"),
                    (data, "num_microbatches"),
                    (data["parallel"]["model"], "dp"),
                    (data["parallel"]["model"], "pp"),
                    (data["parallel"]["model"], "v"),
                    (draw(st.sampled_from(data["stages"])), "index"),
                ]
            )
        )
        target[0][target[1]] = draw(st.sampled_from([v for v in ODD_VALUES if isinstance(v, int)]))
    elif kind == "type":
        key = draw(st.sampled_from(["microbatch_size", "schedule", "stages", "actions", "parallel", "model"]))
        data[key] = draw(st.sampled_from(ODD_VALUES))
    elif kind == "drop_field":
        data.pop(draw(st.sampled_from(sorted(data))))
    elif kind == "recompute":
        layer = draw(st.sampled_from([n for s in data["stages"] for n in s["layers"]]))
        data["recompute"][layer] = draw(st.sampled_from(["full", "none", "selective", "sometimes"]))
    elif kind == "reorder_forwards":
        forwards = [i for i, a in enumerate(acts[rank]) if "F" in a]
        i = draw(st.integers(0, len(forwards) - 2))
        a, b = forwards[i], forwards[i + 1]
        acts[rank][a], acts[rank][b] = acts[rank][b], acts[rank][a]
    elif kind == "rename_layer":
        stage = draw(st.sampled_from(data["stages"]))
        stage["layers"][0] = stage["layers"][0] + "_renamed"
    return kind


def _steps_of_every_plan(runners, batch):
    return [one_step(r, batch) for r in runners]


@pytest.mark.slow
def test_mutated_plans_are_refused_or_train_equal_to_eager(tmp_path):
    model, batch = build("tiny", batch_size=4)
    pipe = compile(model, batch, log=None)
    plan = even_plan(pipe.layer_graph, pp=2, global_batch=4, recompute=(2,))
    original = json.loads(json.dumps(plan.to_json()))  # lists, as in a file
    runnable: dict[str, tuple[list[str], object]] = {}
    refused: list[str] = []

    # Hypothesis draws the mutants; the ones that pass every check all run in one launch below.
    @settings(
        max_examples=NUM_MUTANTS,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(st.data())
    def try_mutant(data):
        mutant = copy.deepcopy(original)
        kinds = [data.draw(mutation(mutant), label="mutation") for _ in range(data.draw(st.integers(1, 3)))]
        text = json.dumps(mutant, sort_keys=True)
        path = tmp_path / "mutant.json"
        path.write_text(text)
        try:
            loaded = Plan.load(path)
            runner = pipe.runner(loaded, timeout_s=30)
            runner.check_batch(batch)
        except (PlanError, BatchError):  # BatchError: the plan's global batch is not this batch's
            refused.append(text)
            return
        except VlmCompileError as err:
            raise AssertionError(f"{kinds} refused with {type(err).__name__}, not PlanError: {err}") from err
        runnable.setdefault(text, (kinds, runner))

    try_mutant()
    print(f"{len(set(refused))} distinct mutants refused, {len(runnable)} ran")  # shown by pytest -s
    assert len(set(refused)) >= 20, f"only {len(set(refused))} distinct mutants refused: a weak fuzzer"
    assert len(runnable) >= 8, f"only {len(runnable)} distinct mutants ran: the runtime was barely fuzzed"
    by_world: dict[int, list[tuple[list[str], object]]] = {}
    for kinds, runner in runnable.values():
        by_world.setdefault(runner.parallel.world_size, []).append((kinds, runner))
    for world, named in by_world.items():
        results = launch(_steps_of_every_plan, [r for _, r in named], world, args=(batch,), timeout_s=30)
        for j, (kinds, _) in enumerate(named):
            try:
                check_equal_to_eager(model, batch, [per_rank[j] for per_rank in results])
            except AssertionError as err:
                raise AssertionError(
                    f"a mutant ({kinds}) ran but trained differently from eager: {err}"
                ) from None
