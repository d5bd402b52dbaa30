"""``vlmcompile train``: a saved plan trained under torchrun (2 CPU processes) like eager, and its
bad inputs refused with a message that says what to do."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.proc_helpers import LOOPBACK, WILDCARD, listening_sockets
from vlmcompile import models
from vlmcompile.cli import main
from vlmcompile.models.synthetic_batches import SyntheticBatches
from vlmcompile.runtime.checkpoint import problems
from vlmcompile.runtime.train_loop import TrainConfig, eager_training

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]


def _plan_file(tmp_path: Path, cluster: str, capsys) -> str:
    path = tmp_path / f"plan-{cluster.replace(':', '')}.json"
    argv = ["plan", "--model", "tiny", "--cluster", cluster, "--tp", "1", "--pp", "2", "--global-batch", "4"]
    assert main([*argv, "--json", str(path)]) == 0
    capsys.readouterr()
    return str(path)


def _torchrun(nprocs: int, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nprocs}"]
    return subprocess.run(
        [*command, "-m", "vlmcompile", "train", *args], capture_output=True, text=True, timeout=timeout
    )


def test_torchrun_trains_a_saved_plan_like_eager(tmp_path, capsys):
    plan = _plan_file(tmp_path, "cpu:2", capsys)
    log = tmp_path / "steps.jsonl"
    args = ["--plan", plan, "--steps", "6", "--lr", "3e-3", "--warmup-steps", "2", "--max-grad-norm", "0.5"]
    done = _torchrun(2, *args, "--log-jsonl", str(log), "--timeout", "60")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "trained steps 1-6" in done.stdout
    got = [json.loads(line)["loss"] for line in log.read_text().splitlines()]
    config = TrainConfig(steps=6, lr=3e-3, warmup_steps=2, max_grad_norm=0.5)
    expected = eager_training(models.build("tiny"), SyntheticBatches("tiny", 4), config)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected))


def test_a_plan_for_more_ranks_than_torchrun_started_is_refused(tmp_path, capsys):
    plan = _plan_file(tmp_path, "cpu:4", capsys)  # PP 2 x DP 2
    done = _torchrun(2, "--plan", plan, "--steps", "1", timeout=120)
    assert done.returncode != 0
    assert "runs on 4 ranks; torchrun started 2" in done.stderr
    assert "rank 0:" in done.stderr and "rank 1:" in done.stderr  # each rank names itself


def test_a_cuda_plan_without_cuda_is_refused_and_runs_on_cpu_when_asked(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    plan = _plan_file(tmp_path, "h100x2", capsys)
    assert main(["train", "--plan", plan, "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert (
        "made for h100x2 and asks for CUDA, but this machine has none; run it on CPU ranks with --device cpu"
        in err
    )
    assert main(["train", "--plan", plan, "--steps", "2", "--device", "cpu", "--timeout", "60"]) == 0
    assert "trained steps 1-2" in capsys.readouterr().out


def test_a_rank_killed_mid_run_ends_the_job_within_the_timeout_naming_it(tmp_path, capsys):
    plan = _plan_file(tmp_path, "cpu:2", capsys)
    log = tmp_path / "steps.jsonl"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    job = subprocess.Popen(
        [*command, "-m", "vlmcompile", "train", "--plan", plan, "--steps", "100000", "--log-jsonl", str(log)]
        + ["--timeout", "20"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (log.exists() and len(log.read_text().splitlines()) >= 3):
            assert job.poll() is None and time.monotonic() < deadline, "the job did not start training"
            time.sleep(0.2)
        victim = _rank_pid(job.pid, rank=1)
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        _, err = job.communicate(timeout=60)
        assert time.monotonic() - killed < 40
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode != 0
    assert "rank: 1" in err and "Signal 9" in err, err[-3000:]


@pytest.mark.extended  # outside CI's 15 minutes (the README's test command runs it)
def test_a_second_run_into_a_directory_holding_checkpoints_is_refused_and_overwrite_starts_again(
    tmp_path, capfd
):
    plan = _plan_file(tmp_path, "cpu:2", capfd)
    ckpt = tmp_path / "ckpt"
    args = [
        "train",
        "--plan",
        plan,
        "--checkpoint-dir",
        str(ckpt),
        "--checkpoint-every",
        "2",
        "--timeout",
        "60",
    ]
    assert main([*args, "--steps", "4"]) == 0
    saved = (ckpt / "step_000004" / "manifest.json").read_text()
    capfd.readouterr()
    assert main([*args, "--steps", "2", "--seed", "1"]) == 2  # another run, not told to resume
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "holds checkpoints of an earlier run (steps 2, 4): continue it with --resume" in err
    assert "or start again with --overwrite" in err
    assert (ckpt / "step_000004" / "manifest.json").read_text() == saved
    assert (ckpt / "latest").read_text() == "step_000004\n"
    assert main([*args, "--steps", "2", "--seed", "1", "--overwrite"]) == 0
    assert "removed the earlier run's checkpoints (steps 2, 4; overwrite)" in capfd.readouterr().err
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_000002"]


def test_sigterm_to_torchrun_saves_the_step_in_flight_and_only_torchrun_listens_beyond_loopback(
    tmp_path, capsys
):
    """The README's torchrun command: SIGTERM to torchrun reaches every rank, which finishes its
    step and saves; while it trains, the ranks listen on 127.0.0.1 only and torchrun's own
    rendezvous store on every interface (as the README says)."""
    plan = _plan_file(tmp_path, "cpu:2", capsys)
    ckpt = tmp_path / "ckpt"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    command += ["--signals-to-handle", "SIGTERM,SIGUSR1", "-m", "vlmcompile", "train", "--plan", plan]
    command += ["--steps", "100000", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "100000"]
    job = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"},
        start_new_session=True,
    )
    try:
        seen = ""
        while "step 3: loss" not in seen:
            line = job.stderr.readline()
            assert line, f"the job ended before step 3:\n{seen[-3000:]}"
            seen += line
        for rank in (0, 1):
            sockets = listening_sockets(_rank_pid(job.pid, rank))
            assert all(address in LOOPBACK for address, _ in sockets), (rank, sockets)
        agent = listening_sockets(job.pid)
        assert agent and all(address in WILDCARD for address, _ in agent), agent
        job.send_signal(signal.SIGTERM)
        _, err = job.communicate(timeout=120)
        err = seen + err
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    found = re.search(r"stopped by SIGTERM after step (\d+) of 100000: saved (\S+); resume goes on", err)
    assert found, err[-3000:]
    # torchrun's own ending, as the README says: exit 1 and its SignalException traceback.
    assert job.returncode == 1 and "SignalException" in err
    assert found.group(2) == str(ckpt / f"step_{int(found.group(1)):06d}")
    assert problems(found.group(2)) == []


def _rank_pid(torchrun_pid: int, rank: int) -> int:
    """The pid of the torchrun worker with ``RANK=rank`` (a child of torchrun's process)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if parent == torchrun_pid and f"RANK={rank}".encode() in environ:
            return int(entry.name)
    raise AssertionError(f"no worker with RANK={rank} under pid {torchrun_pid}")


@pytest.mark.slow
@pytest.mark.extended  # 26 s: not in .ci/run (CI time); run by the README's test command
def test_the_gpu_check_runs_dry_on_cpu_ranks(tmp_path):
    """benchmarks/gpu_check.py waits for a GPU; its dry run takes every step of it on CPU ranks
    (plans, torchrun in fp32 and bf16 on 1 and 2 ranks, a transformers LLaVA in bf16, ZeRO-1 at DP = 2,
    eager comparison, measured against predicted memory, calibration)."""
    out = tmp_path / "check.json"
    script = Path(__file__).parent.parent / "benchmarks" / "gpu_check.py"
    command = [
        sys.executable,
        str(script),
        "--device",
        "cpu",
        "--steps",
        "2",
        "--repeats",
        "1",
        "--model",
        "tiny",  # every step of the script, on the zoo's smallest model: the demo's adds a minute
        "--out",
        str(out),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["device"].startswith("CPU") and result["backend"] == "gloo"
    runs = {
        (r.get("model", "tiny"), r["cluster"], r["precision"], r.get("zero_stage", 0)): r
        for r in result["runs"]
    }
    assert set(runs) == {
        ("tiny", "cpu:1", "fp32", 0),
        ("tiny", "cpu:1", "bf16", 0),
        ("tiny", "cpu:2", "fp32", 0),
        ("tiny", "cpu:2", "fp32", 1),
        ("hf-llava", "cpu:1", "bf16", 0),
    }
    assert all(runs[k]["equals_eager"] for k in runs if k[2] == "fp32")
    assert runs[("hf-llava", "cpu:1", "bf16", 0)]["finite"]
    assert all(len(r["tensor_memory_error_per_rank"]) == int(r["cluster"][4:]) for r in runs.values())
    assert (
        result["calibration"]["layers"] > 0 and 0 < result["calibration"]["fitted_efficiency"]["matmul"] <= 1
    )


@pytest.mark.extended  # outside CI's 15 minutes (the README's test command runs it)
def test_a_run_saved_under_torchrun_resumes_on_local_ranks_with_the_same_losses(tmp_path, capsys):
    plan = _plan_file(tmp_path, "cpu:2", capsys)
    ckpt, whole, resumed = tmp_path / "ckpt", tmp_path / "whole.jsonl", tmp_path / "resumed.jsonl"
    args = [
        "--plan",
        plan,
        "--steps",
        "4",
        "--lr",
        "3e-3",
        "--checkpoint-dir",
        str(ckpt),
        "--checkpoint-every",
        "2",
    ]
    done = _torchrun(2, *args, "--log-jsonl", str(whole), "--timeout", "60")
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in ckpt.iterdir()) == [
        ".vlmcompile.lock",
        "latest",
        "step_000002",
        "step_000004",
    ]
    shutil.rmtree(ckpt / "step_000004")  # as if stopped after step 2
    assert main(["train", *args, "--resume", "--log-jsonl", str(resumed), "--timeout", "60"]) == 0
    assert "trained steps 3-4" in capsys.readouterr().out
    losses = [json.loads(line)["loss"] for line in whole.read_text().splitlines()]
    again = [json.loads(line) for line in resumed.read_text().splitlines()]
    assert [x["step"] for x in again] == [3, 4]
    torch.testing.assert_close(torch.tensor([x["loss"] for x in again]), torch.tensor(losses[2:]))


@pytest.mark.extended  # outside CI's 15 minutes (the README's test command runs it)
def test_plan_and_train_with_data_of_any_shape_train_like_eager(tmp_path, capsys):
    """``plan --data`` and ``train --data`` on local ranks: samples of a synthetic dataset with
    their images and lengths, packed; the losses equal eager's on the same steps' samples."""
    from vlmcompile import families
    from vlmcompile.compiler import compile
    from vlmcompile.data.steps import PaddedSteps
    from vlmcompile.data.synthetic import dataset_from_spec
    from vlmcompile.ir.plan import Plan
    from vlmcompile.runtime.global_batches import GlobalBatches

    data = ["--data", "synthetic:interleaved", "--text-scale", "0.02", "--data-samples", "64"]
    plan = tmp_path / "plan.json"
    argv = ["plan", "--model", "tiny", "--cluster", "cpu:2", "--tp", "1", "--pp", "2", "--global-batch", "8"]
    assert main([*argv, *data, "--json", str(plan)]) == 0
    assert "planned for the dataset" in capsys.readouterr().err
    log = tmp_path / "steps.jsonl"
    assert (
        main(
            [
                "train",
                "--plan",
                str(plan),
                *data,
                "--global-batch",
                "8",
                "--steps",
                "6",
                "--lr",
                "3e-3",
                "--log-jsonl",
                str(log),
            ]
        )
        == 0
    )
    got = [json.loads(line)["loss"] for line in log.read_text().splitlines()]
    model = models.build("tiny")
    dataset = dataset_from_spec(
        "synthetic:interleaved", families.layout_of(model), num_samples=64, text_scale=0.02
    )
    pipe = compile(model, dataset=dataset, global_batch=8, log=None)
    steps = pipe.packed_steps(GlobalBatches(dataset, 8), Plan.load(str(plan)))
    expected = eager_training(models.build("tiny"), PaddedSteps(steps), TrainConfig(steps=6, lr=3e-3))
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected))


def test_bad_data_is_one_line(tmp_path, capsys):
    plan = _plan_file(tmp_path, "cpu:2", capsys)
    assert main(["train", "--plan", plan, "--data", "synthetic:coco", "--steps", "1"]) != 0
    assert "unknown synthetic dataset 'coco'" in capsys.readouterr().err
    manifest = tmp_path / "m.jsonl"
    manifest.write_text('{"text_tokens": 4}\n{"text_tokens": 5, "images": [[0, 3]]}\n')
    assert main(["train", "--plan", plan, "--data", str(manifest), "--steps", "1"]) != 0
    assert "m.jsonl:2: images[0]=[0, 3]" in capsys.readouterr().err


@pytest.mark.parametrize("freeze", ["vision", "vision,llm,head"], ids=["frozen-vision", "llava-stage-1"])
def test_a_frozen_plan_trains_exactly_its_frozen_set_from_the_cli(tmp_path, capsys, freeze):
    """``plan --freeze`` keeps the frozen layers in the plan; ``train`` freezes them (``--freeze``
    agreeing is accepted): the frozen weights come out of the checkpoint bit for bit, the rest
    trains, the losses are eager's on the model frozen alike (LLaVA's stage 1: the projector alone)."""
    from vlmcompile.ir.plan import Plan
    from vlmcompile.runtime.checkpoint import load_checkpoint

    plan = tmp_path / "plan.json"
    argv = ["plan", "--model", "tiny", "--cluster", "cpu:2", "--tp", "1", "--pp", "2", "--global-batch", "4"]
    assert main([*argv, "--freeze", freeze, "--json", str(plan)]) == 0
    log, ckpt = tmp_path / "steps.jsonl", tmp_path / "ckpt"
    args = ["--steps", "3", "--lr", "3e-3", "--checkpoint-dir", str(ckpt), "--log-jsonl", str(log)]
    assert main(["train", "--plan", str(plan), "--freeze", freeze, *args, "--timeout", "60"]) == 0
    capsys.readouterr()

    model = models.build("tiny")
    for layer in Plan.load(plan).frozen:
        model.get_submodule(layer).requires_grad_(False)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    trains = {n for n, p in model.named_parameters() if p.requires_grad}
    if freeze == "vision,llm,head":
        assert trains and all(n.startswith("projectors.") for n in trains)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    expected = eager_training(model, SyntheticBatches("tiny", 4), TrainConfig(steps=3, lr=3e-3))
    got = [json.loads(line)["loss"] for line in log.read_text().splitlines()]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected))
    saved = load_checkpoint(ckpt)["model"]
    assert all(torch.equal(saved[n], before[n]) for n in frozen), "a frozen weight changed"
    assert all(not torch.equal(saved[n], before[n]) for n in trains if n.endswith("weight"))


def test_a_global_batch_the_plan_cannot_hold_is_refused_and_a_resume_may_change_it(tmp_path, capsys):
    """The plan holds 8 samples a step of a 40-sample manifest: 32 are refused before any rank
    starts, naming the most it holds; a run of that many, resumed with 8 a step, goes on in the
    stream where its checkpoint left it (no sample skipped or trained twice)."""
    import random

    rng = random.Random(0)
    manifest = tmp_path / "good.jsonl"
    rows = [
        {"text_tokens": rng.randint(12, 50), "images": [[336, 336]] * rng.randint(0, 2)} for _ in range(40)
    ]
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    plan = tmp_path / "plan.json"
    argv = ["plan", "--model", "tiny", "--cluster", "cpu:2", "--tp", "1", "--pp", "2", "--global-batch", "8"]
    assert main([*argv, "--data", str(manifest), "--json", str(plan)]) == 0
    capsys.readouterr()
    train = ["train", "--plan", str(plan), "--data", str(manifest), "--timeout", "60"]
    assert main([*train, "--global-batch", "32", "--steps", "8"]) == 2
    err = capsys.readouterr().err
    assert "cannot hold 32 samples a step of this data" in err and "step 1: loss" not in err, err
    fits = int(re.search(r"The most they hold is (\d+) a step", err).group(1))
    assert 8 <= fits < 32

    ckpt, log = tmp_path / "ckpt", tmp_path / "steps.jsonl"
    run = [*train, "--checkpoint-dir", str(ckpt), "--log-jsonl", str(log), "--decay-steps", "4"]
    assert main([*run, "--global-batch", str(fits), "--steps", "4"]) == 0
    assert main([*run, "--global-batch", "8", "--steps", "6", "--resume"]) == 0
    out = capsys.readouterr().out
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3, 4, 5, 6]
    # Steps 5 and 6 took 8 new samples each (and what step 4 left): the stream went on from 4 x fits.
    epochs = float(re.findall(r"\((\d+\.\d+) epochs of the dataset in all, no sample left out\)", out)[-1])
    assert epochs == pytest.approx((4 * fits + 16) / 40, abs=0.005)
    assert sum(x["samples"] for x in lines) + lines[-1]["deferred_samples"] == 4 * fits + 16


USER_CODE = Path(__file__).resolve().parent / "user_code"
"""A user's own module (my_qwen.py): a transformers Qwen2-VL and its samples, built there."""


@pytest.mark.hf
def test_a_users_own_model_and_data_plan_and_train_from_the_cli_like_eager(tmp_path, capsys, monkeypatch):
    """``--model my_qwen:build_model --data my_qwen:samples``, found from the folder the command
    runs in: planned with our policy by default, trained on 2 local ranks and under torchrun,
    both with eager's losses on the same steps' samples."""
    from vlmcompile.compiler import compile
    from vlmcompile.data.steps import PaddedSteps
    from vlmcompile.ir.plan import Plan
    from vlmcompile.runtime.global_batches import GlobalBatches

    monkeypatch.chdir(USER_CODE)
    own = ["--model", "my_qwen:build_model", "--data", "my_qwen:samples", "--global-batch", "4"]
    plan = tmp_path / "plan.json"
    assert main(["plan", *own, "--cluster", "cpu:2", "--search", "--json", str(plan)]) == 0
    capsys.readouterr()
    assert Plan.load(str(plan)).policy == "vlmcompile"
    train = ["train", "--plan", str(plan), *own[2:], "--steps", "3", "--lr", "3e-3"]
    local, under_torchrun = tmp_path / "local.jsonl", tmp_path / "torchrun.jsonl"
    assert main([*train, "--log-jsonl", str(local)]) == 0  # the plan names the model
    done = _torchrun(2, *train[1:], "--log-jsonl", str(under_torchrun), "--timeout", "60")
    assert done.returncode == 0, done.stderr[-3000:]

    import my_qwen  # on the path from the commands above (the folder they ran in)

    samples = my_qwen.samples()
    pipe = compile(my_qwen.build_model(), dataset=samples, global_batch=4, log=None)
    steps = pipe.packed_steps(GlobalBatches(samples, 4), Plan.load(str(plan)))
    expected = eager_training(my_qwen.build_model(), PaddedSteps(steps), TrainConfig(steps=3, lr=3e-3))
    for log in (local, under_torchrun):
        got = [json.loads(line)["loss"] for line in log.read_text().splitlines()]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected))


def _readme_training_commands() -> list[list[str]]:
    """The README's ``vlmcompile train`` block, each command as argv (continuations joined,
    comments dropped)."""
    import shlex

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = readme.split("`vlmcompile train` does the same", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    joined = block.replace("\\\n", " ")
    return [shlex.split(line) for line in joined.splitlines() if line.strip() and not line.startswith("#")]


@pytest.mark.slow
@pytest.mark.extended  # 70 s; the Python examples' twice-run (tests/test_docs.py) stays in CI
def test_the_readmes_training_commands_run_twice_in_one_folder_alike(tmp_path):
    """Plan, then train under torchrun with checkpoints, as the README has it, twice in the same
    folder (the steps cut from 30 to 4 and the saves from every 10 to every 2, for time): both
    runs succeed and train the same losses."""
    commands = _readme_training_commands()
    assert [c[:1] for c in commands] == [["vlmcompile"], ["GLOO_SOCKET_IFNAME=lo"]], commands
    shorter = {"30": "4", "10": "2"}
    runs = []
    for _ in range(2):
        outputs = []
        for argv in commands:
            env = dict(os.environ)
            while "=" in argv[0]:  # VAR=value before the command
                key, value = argv.pop(0).split("=", 1)
                env[key] = value
            argv = [
                shorter.get(a, a) if i and argv[i - 1] in ("--steps", "--checkpoint-every") else a
                for i, a in enumerate(argv)
            ]
            program = {
                "vlmcompile": [sys.executable, "-m", "vlmcompile"],
                "torchrun": [sys.executable, "-m", "torch.distributed.run"],
            }[argv[0]]
            done = subprocess.run(
                [*program, *argv[1:]], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
            )
            assert done.returncode == 0, (argv, done.stderr[-3000:])
            outputs.append(done.stdout)
        runs.append(re.search(r"loss [\d.]+ -> [\d.]+", outputs[-1]).group(0))
    assert runs[0] == runs[1], runs
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step_*")) == ["step_000002", "step_000004"]
