"""``vlmcompile plan``: prints the plan, the simulated step and its bubbles; writes JSON,
trace and PNG; bad input is an error message and exit code 2."""

import json
import subprocess
import sys

import pytest

from vlmcompile.cli import main
from vlmcompile.ir.plan import Plan
from vlmcompile.passes.planning.policies import BASELINES

ARGS = ["plan", "--model", "demo", "--cluster", "h100x16", "--tp", "2", "--pp", "4", "--global-batch", "16"]


def test_plan_prints_and_writes_everything(tmp_path, capsys):
    out = tmp_path / "plan.json"
    code = main(
        [
            *ARGS,
            "--policy",
            "megatron_balanced",
            "--json",
            str(out),
            "--trace",
            str(tmp_path / "t.json"),
            "--png",
            str(tmp_path / "t.png"),
        ]
    )
    printed = capsys.readouterr().out
    assert code == 0
    assert "plan 'megatron_balanced' for demo on h100x16" in printed
    assert "simulated step" in printed and "bubbles by cause" in printed and "pp_warmup" in printed
    # Planned with Megatron-LM's bytes on GPUs: what our runtime would hold is said beside it.
    assert (
        "as our runtime trains it (bf16 autocast; fp32 parameters, gradients and AdamW states): peak"
        in printed
    )
    assert "within it: pipe.train takes it" in printed
    data = json.loads(out.read_text())
    plan = Plan.from_json(data["plan"])
    assert plan.policy == "megatron_balanced" and plan.num_ranks == 4
    assert data["simulation"]["step_time_s"] > 0 and "prediction" in data["simulation"]["note"]
    assert set(data["simulation"]["bubble_share_by_cause"]) >= {"pp_warmup", "tp_comm", "dp_reduce_scatter"}
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert (tmp_path / "t.png").stat().st_size > 0


def test_freeze_plans_every_policy_for_the_frozen_parameters(tmp_path, capsys):
    steps = {}
    for freeze in ([], ["--freeze", "vision"], ["--freeze", "vision,llm,head"]):
        out = tmp_path / f"{len(freeze)}-{freeze[-1] if freeze else ''}.json"
        assert main([*ARGS, "--policy", "megatron_balanced", *freeze, "--json", str(out)]) == 0
        data = json.loads(out.read_text())
        steps[freeze[-1] if freeze else ""] = data["simulation"]["step_time_s"]
        assert 0 < data["llm_alone_step_s"] < data["simulation"]["step_time_s"]
        assert 0 < data["dependency_bound_s"] < data["simulation"]["step_time_s"]
        frozen = list(Plan.from_json(data).frozen)
        if not freeze:
            assert frozen == []
        else:
            assert frozen[0] == "encoders.0.embed" and all(not n.startswith("projectors") for n in frozen)
    assert "frozen: 6 of 18 layers" in capsys.readouterr().err
    # Less backward work each time: the vision tower's, then the LLM's weight gradients.
    assert steps[""] > steps["vision"] > steps["vision,llm,head"]


def test_megatron_plan_prints_its_layout(capsys):
    assert main([*ARGS, "--policy", "megatron", "--recompute", "none"]) == 0
    assert '--pipeline-model-parallel-layout "Ett|tt|tt|ttL"' in capsys.readouterr().out


def test_bad_input_is_an_error_message(capsys):
    assert (
        main(
            [
                "plan",
                "--model",
                "demo",
                "--cluster",
                "h100x12",
                "--tp",
                "2",
                "--pp",
                "4",
                "--global-batch",
                "16",
            ]
        )
        == 2
    )
    assert "12 GPUs do not fill nodes of 8" in capsys.readouterr().err
    assert main([*ARGS[:-2]]) == 2
    assert "missing --global-batch" in capsys.readouterr().err
    assert main(["plan", "--setup", "optimus-weak-Z"]) == 2
    assert "unknown setup 'optimus-weak-Z'" in capsys.readouterr().err


def test_vlmcompile_policy_prints_the_comparison_with_every_baseline(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main([*ARGS, "--policy", "vlmcompile", "--time-limit", "5", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "CP-SAT" in printed and "policies at the same degrees" in printed
    for policy in BASELINES:
        assert policy in printed
    data = json.loads(out.read_text())
    assert Plan.from_json(data["plan"]).policy == "vlmcompile"
    assert {r["policy"] for r in data["policies"]} == set(BASELINES)


@pytest.mark.slow
@pytest.mark.extended  # outside CI's 15 minutes (the README's test command runs it)
def test_omnibal_policy_and_search(capsys):
    assert main([*ARGS, "--policy", "omnibal"]) == 0
    assert "anchor cuts" in capsys.readouterr().out
    search = [
        "plan",
        "--model",
        "demo",
        "--cluster",
        "h100x8",
        "--global-batch",
        "16",
        "--policy",
        "vlmcompile",
    ]
    # A short solver limit: the test reads what the search prints, not how good its plan is.
    assert main([*search, "--search", "--tp", "2", "--v", "2", "--time-limit", "2"]) == 0
    out = capsys.readouterr()
    assert "plan search on h100x8" in out.out
    assert "warning: ignoring --tp, --v: --search chooses them itself" in out.err


def test_a_flag_the_policy_does_not_read_is_named(capsys):
    assert main([*ARGS, "--policy", "omnibal", "--first-stage-layers", "2"]) == 0
    assert (
        "ignoring --first-stage-layers: only the megatron policy reads them, not omnibal"
        in capsys.readouterr().err
    )


def test_per_layer_policies_refuse_a_global_recompute(capsys):
    assert main([*ARGS, "--policy", "omnibal", "--recompute", "full"]) == 2
    assert "chooses recompute per layer" in capsys.readouterr().err


@pytest.mark.parametrize("command", [[], ["annotate"], ["plan"], ["demo"], ["run"], ["train"]])
def test_help_is_plain_text_and_shows_every_default(command, capsys):
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    out = capsys.readouterr().out
    assert "``" not in out, "reStructuredText markup in --help"
    flat = " ".join(out.split())
    if command == ["train"]:
        for shown in (
            "training steps (default: 10)",
            "linear warm-up steps (default: 0)",
            "AdamW's decoupled weight decay (default: 0.1)",
            "LR decay after warm-up (default: cosine)",
        ):
            assert shown in flat, shown


def test_the_command_line_is_built_without_torch_and_planning_without_dcp():
    """``vlmcompile plan --help`` imports no torch (about 1.2 s instead of 3.2 s here), and planning
    imports no torch.distributed.checkpoint (a second of import), which only training uses."""
    code = (
        "import sys\n"
        "from vlmcompile.cli import parser\n"
        "parser()\n"
        "print('torch' in sys.modules)\n"
        "import vlmcompile.compiler\n"
        "print('torch.distributed.checkpoint' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split() == ["False", "False"], out.stdout + out.stderr


def test_a_gpu_plan_our_runtime_would_not_fit_is_said_to_be_refused(demo_graph):
    """Between the plan's own peak (Megatron-LM's bytes) and our runtime's, the report says the
    runtime refuses it; on local ranks, planned with the runtime's bytes, it says nothing."""
    from vlmcompile.cli import _runtime_memory
    from vlmcompile.cost_models.cluster import Cluster
    from vlmcompile.ir.plan import Precision
    from vlmcompile.passes.planning.policies import plan_and_simulate
    from vlmcompile.planning.request import PlanRequest
    from vlmcompile.sim.simulator import peak_memory_bytes

    cluster = Cluster.preset("h100x16")
    run = plan_and_simulate(
        demo_graph, cluster, "megatron_balanced", PlanRequest.on(cluster, tp=2, pp=4, global_batch=16)
    )
    planned = max(peak_memory_bytes(run.plan, demo_graph, cluster))
    held = max(peak_memory_bytes(run.plan, demo_graph, cluster, precision=Precision.runtime(autocast=True)))
    assert held > planned  # DP = 2 at ZeRO-1: 14 + 8 / 2 bytes a parameter against 6 + 12 / 2
    said = _runtime_memory(run, demo_graph, cluster.with_memory_cap((planned + held) / 2))
    assert "over it on" in said and "pipe.train refuses it before launch" in said
    local = Cluster.preset("cpu:8")
    on_local = plan_and_simulate(
        demo_graph, local, "megatron_balanced", PlanRequest.on(local, tp=1, pp=4, global_batch=16)
    )
    assert _runtime_memory(on_local, demo_graph, local) is None
