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
    assert "[1/2] capture" in log.getvalue() and "[2/2] annotate done" in log.getvalue()
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
