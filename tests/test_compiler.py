import io
import json

import pytest

import vlmcompile
from tests.models import build
from vlmcompile import SampleBatchError
from vlmcompile.cli import main


def test_compile_returns_graph_layer_graph_and_a_readable_report():
    model, batch = build("tiny")
    log = io.StringIO()
    pipe = vlmcompile.compile(model, batch, log=log)
    text = str(pipe.report)
    assert (
        "== capture ==" in text
        and "== annotate ==" in text
        and "per region:" in text
        and "per layer:" in text
    )
    assert "llm.blocks.1" in text
    assert "[1/4] capture" in log.getvalue() and "[2/4] annotate done" in log.getvalue()
    assert pipe.codegen is None and "no plan: nothing to split" in text
    assert "no cluster given" in text
    assert len(pipe.layer_graph) == 10


def test_compile_errors_name_the_pass():
    model, batch = build("tiny")
    with pytest.raises(SampleBatchError, match=r"in pass 1 'capture'; passes already run: none"):
        vlmcompile.compile(model, {"pixel_values": batch["pixel_values"]}, log=None)


def test_cli_annotate_prints_the_report_and_writes_json(tmp_path, capsys):
    out = tmp_path / "layers.json"
    assert main(["annotate", "--model", "tiny-two-encoder", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "per region:" in printed and "encoders.1.blocks.0" in printed
    data = json.loads(out.read_text())
    assert data["meta"]["model"] == "tiny-two-encoder"
    assert len(data["layers"]) == 15 and all("fwd_flops" in layer for layer in data["layers"])


def test_cli_reports_bad_names_as_errors(capsys):
    assert main(["annotate", "--model", "GPT-5"]) == 2
    assert "unknown model 'GPT-5'" in capsys.readouterr().err


def test_a_compiled_pipeline_plans_and_simulates_the_megatron_baseline():
    model, batch = build("tiny")
    pipe = vlmcompile.compile(model, batch, cluster="h100x8", log=None)
    run = pipe.baseline("megatron", tp=1, pp=2, global_batch=8)
    assert run.plan.num_ranks == 2 and run.sim.step_time_s > 0 and run.fits
    with pytest.raises(ValueError, match="given no cluster"):
        vlmcompile.compile(model, batch, log=None).baseline()


def test_compile_with_a_cluster_returns_the_partition_pass_plan_and_the_comparison():
    model, batch = build("tiny")
    pipe = vlmcompile.compile(model, batch, cluster="h100x8", log=None)
    assert pipe.plan is not None and pipe.plan.policy == "vlmcompile"
    pipe.plan.validate(pipe.layer_graph)
    report = str(pipe.report)
    assert "plan search on h100x8" in report and "policies at the same degrees" in report
    # The codegen pass split the graph along the plan: one module per stage, every layer once.
    assert len(pipe.codegen.stages) == pipe.plan.num_stages and "== codegen ==" in report
    assert [w.name for s in pipe.codegen.stages for w in s.wiring] == [
        x.name for x in pipe.layer_graph.layers
    ]
    ours = pipe.planned.sim.step_time_s
    for row in pipe.planned.baselines:
        if row.step_s is not None and row.fits:
            assert ours <= row.step_s * (1 + 1e-9), row


def test_freeze_layers_freezes_the_modules_a_region_or_path_names_and_a_new_compile_plans_it():
    from tests.models import build
    from vlmcompile import compile, freeze_layers
    from vlmcompile.ir.errors import ArgumentError

    model, batch = build("tiny", batch_size=2)
    pipe = compile(model, batch, log=None)
    with pytest.raises(ArgumentError, match="'visoin' names no layer"):
        freeze_layers(model, pipe.layer_graph, ["visoin"])
    assert all(p.requires_grad for p in model.parameters()), "a refused call froze something"
    chosen = freeze_layers(model, pipe.layer_graph, ["vision", "llm.blocks.0"])
    assert chosen == pipe.layer_graph.select(["vision", "llm.blocks.0"])
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {n for n, _ in model.named_parameters() if n.startswith(("encoders.", "llm.blocks.0."))}
    again = compile(model, batch, log=None).layer_graph
    assert again.totals()["num_frozen_params"] == sum(
        p.numel() for p in model.parameters() if not p.requires_grad
    )
    assert again.forward_only() == {layer.name for layer in again.layers if layer.region.value == "vision"}


@pytest.mark.slow  # two interpreters importing transformers
@pytest.mark.parametrize(
    "mistake, message",
    [
        ('batch["images"] = batch.pop("pixel_values")', "did you mean 'pixel_values'?"),
        ('batch.pop("labels")', "with no loss in it"),
    ],
    ids=["misnamed-key", "no-labels"],
)
def test_a_users_mistake_through_the_api_prints_one_short_error(tmp_path, mistake, message):
    """The exception a script sees is the message that says what to fix: no chain of internal
    frames or exceptions behind it (10 lines printed at most)."""
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "mine.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import vlmcompile
            from vlmcompile import families

            model, batch = families.build_tiny("llava")
            {mistake}
            vlmcompile.compile(model, batch, log=None)
            """
        )
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240)
    printed = [line for line in done.stderr.splitlines() if "Warning" not in line and line.strip()]
    assert done.returncode == 1 and message in printed[-1], done.stderr
    assert len(printed) <= 10, done.stderr
    assert "During handling" not in done.stderr and "direct cause" not in done.stderr, done.stderr


def test_plan_png_draws_the_plan_and_a_profiled_cpu_plan_never_shows_mfu_over_100_percent(tmp_path):
    """pipe.plan_png draws the step from Python; profiled on this CPU, the device's peak is at
    least the fastest layer's rate, so the simulated MFU stays a share."""
    model, batch = build("tiny", batch_size=4)
    pipe = vlmcompile.compile(model, batch, cluster="cpu:2", profile=True, log=None)
    assert pipe.cluster.device.peak_flops_per_s >= pipe.layer_graph.fastest_measured_rate() > 0
    assert 0 < pipe.planned.sim.mfu <= 1
    written = pipe.plan_png(tmp_path / "plan.png")
    assert written.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(vlmcompile.VlmCompileError, match="which does not exist"):
        pipe.plan_png(tmp_path / "no" / "plan.png")
