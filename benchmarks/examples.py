"""Regenerate every printed example of README.md and docs/*.md, or check that none is stale.

    python benchmarks/examples.py                   # rewrite every block in place
    python benchmarks/examples.py --check           # rewrite nothing; exit 1 naming each stale block
    python benchmarks/examples.py --only annotate   # only the blocks whose spec contains "annotate"
    python benchmarks/examples.py --python          # also the Python examples (local ranks: slower)

``tests/test_docs.py`` runs ``--check`` (the Python examples in the slow lane).

Three kinds of block:

1. **Command output.** ::

       <!-- example: vlmcompile annotate --model demo -->
       ```text
       ...its stdout...
       ```
       <!-- /example -->

   ``vlmcompile ...`` runs in this process through ``vlmcompile.cli.main`` (stdout kept, stderr
   dropped). ``recorded vlmcompile demo ...`` is too slow to run here (minutes): its closing summary
   is rebuilt from the run the benchmark recorded (``benchmarks/results/demo_speedup.json``, the
   run with the median speedup). Options after ``; `` abridge: ``; from "TEXT"`` keeps the lines
   from the first that starts with TEXT, ``; until "TEXT"`` those before the first that does;
   ``...`` marks what is left out.
2. **Python example output.** ``<!-- example: python NAME -->`` shows the stdout of the Python
   block marked ``<!-- example-source: NAME -->`` (a fenced ``python`` block right after it, in the
   same file), run as a script in a temporary directory. These start local ranks and need
   transformers, so they run only with ``--python``.
3. **Generated sections** between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->``: the headline
   (made here, from ``benchmarks/results/*.json``), and the tables whose benchmark re-renders its
   saved results (``--no-run``): :data:`RERENDERED`. Every other section is written only by its
   benchmark's run (``--readme``); :data:`RUN_ONLY` names some of them, with that command.

Comparing (``--check``): figures that vary from run to run are masked on both sides first
(:data:`MASKS`: wall-clock seconds, measured rates, MFU and peak memory of measured runs), and
runs of spaces and of table rules are collapsed (a masked figure may change a column's width).
Everything else must match.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import importlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))
from readme_section import ROOT, documents, markers, read_section, replace_section  # noqa: E402

RESULTS = BENCHMARKS / "results"

EXAMPLE = re.compile(r"<!-- example: (?P<spec>.+?) -->\n(?P<body>.*?)<!-- /example -->\n?", re.S)
SOURCE = re.compile(r"<!-- example-source: (?P<name>[\w.-]+) -->\n```python\n(?P<code>.*?)```", re.S)
SECTION = re.compile(r"<!-- (?P<name>[\w.-]+):begin -->")

MASKS: tuple[tuple[re.Pattern[str], str], ...] = (
    # wall-clock seconds: pass and phase times, measured steps, solver times ("0.32 s", "9.99 s)")
    (re.compile(r"\d+(?:\.\d+)?(?= s\b)"), "<s>"),
    # measured rates ("367.58 samples/s", "4.4 K tokens/s")
    (re.compile(r"\d+(?:\.\d+)?(?: K)?(?= (?:samples|tokens)/s)"), "<rate>"),
    # MFU and peak memory of a measured run ("MFU 0.5 %", "peak memory 0.47 GiB", "peak mem 0.47 GiB");
    # the simulator's are written "MFU (model FLOPs) 31.0 %" and "peak memory: 53.47 GiB" and stay
    (re.compile(r"(MFU )\d+(?:\.\d+)?(?= %)"), r"\1<mfu>"),
    (re.compile(r"(peak mem(?:ory)? )\d+(?:\.\d+)?(?= GiB)"), r"\1<mem>"),
    # measured peak tensor memory against its prediction ("tensors at their peak (step 2) 499.54 KiB on
    # rank 0 (predicted 476.62 KiB, -5%)"): the measured side, and so the rank and error, vary
    (re.compile(r"(tensors(?: at their peak \(step \d+\))?) [^;(]*\(predicted [^)]*\)"), r"\1 <tensors>"),
)
"""Figures that differ between two runs of the same command: (pattern, replacement)."""

RERENDERED: dict[str, tuple[str, ...]] = {
    "bubbles": ("bubbles.py", "--no-run"),
    "demo_speedup_4": ("demo_speedup.py", "--no-run", "--global-batch", "4"),
    "demo_speedup_32": ("demo_speedup.py", "--no-run", "--global-batch", "32"),
    "demo_speedup_4_cap0.6": ("demo_speedup.py", "--no-run", "--global-batch", "4", "--memory-cap", "0.6"),
    "demo_speedup_4_cap0.6_frozen_vision": (
        "demo_speedup.py",
        "--no-run",
        "--global-batch",
        "4",
        "--memory-cap",
        "0.6",
        "--freeze",
        "vision",
    ),
}
"""Section -> the benchmark command that prints it again from its saved results."""

RUN_ONLY: dict[str, str] = {
    "partition": "python benchmarks/partition.py --readme",  # its table is history (docs/history.md)
    "fidelity": "python benchmarks/fidelity.py --readme",
    "plan_baselines": "python benchmarks/plan_baselines.py --readme",
    "transformers_support": "python benchmarks/support_table.py --readme",
}
"""Section -> the command that writes it, for some of the sections written only by their
benchmark's run (it saves no table to print again); the others are not listed here."""


# ---- rendering -------------------------------------------------------------------------------
class ExampleError(Exception):
    """A block could not be rendered (its command failed, or its spec is unknown)."""


@contextlib.contextmanager
def _quiet_stderr():
    """Send fd 2 (Python's and C's stderr: progress lines, solver logs) to a file; yields a
    function that returns what was written, for error messages."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            with contextlib.redirect_stderr(sink):

                def written() -> str:
                    sink.flush()
                    sink.seek(0)
                    return sink.read()

                yield written
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


def run_cli(argv: list[str]) -> str:
    """``vlmcompile ARGV``'s stdout, run in this process."""
    from vlmcompile import cli

    out = io.StringIO()
    with _quiet_stderr() as written, contextlib.redirect_stdout(out):
        rc = cli.main(argv)
        errors = written()
    if rc != 0:
        raise ExampleError(f"`vlmcompile {shlex.join(argv)}` exited {rc}: {errors.strip()[-2000:]}")
    return out.getvalue()


def recorded_demo(argv: list[str]) -> str:
    """The closing summary ``vlmcompile demo ARGV`` prints, rebuilt from the median run (by
    speedup) that ``benchmarks/demo_speedup.py`` recorded at the same global batch and steps."""
    from vlmcompile import demo

    parser = argparse.ArgumentParser(prog="vlmcompile demo", add_help=False)
    parser.add_argument("--full", action="store_true")
    parser.add_argument("--global-batch", type=int)
    parser.add_argument("--steps", type=int, default=demo.DEFAULT_STEPS)
    args = parser.parse_args(argv)
    batch = demo.FULL_GLOBAL_BATCH if args.full else args.global_batch or demo.DEFAULT_GLOBAL_BATCH
    path = RESULTS / "demo_speedup.json"
    entry = json.loads(path.read_text()).get(str(batch))
    runs = [r for r in (entry or {}).get("runs", []) if r.get("num_steps") == args.steps]
    if not runs:
        raise ExampleError(
            f"{path.relative_to(ROOT)} records no demo run at global batch {batch} and {args.steps} steps: "
            f"python benchmarks/demo_speedup.py --global-batch {batch} --steps {args.steps}"
        )
    runs.sort(key=lambda r: r["speedup"])
    run = runs[(len(runs) - 1) // 2]
    try:
        result = demo.DemoResult(
            **_fields_of(demo.DemoResult, run),
            runs=tuple(demo.PlanRun(**_fields_of(demo.PlanRun, p)) for p in run["runs"]),
            command=demo.demo_command(batch, args.steps),
        )
    except TypeError as err:  # the result type gained a field the recorded run lacks
        raise ExampleError(
            f"the recorded demo run no longer fits vlmcompile.demo.DemoResult: {err}"
        ) from None
    return str(result) + "\n"


def _fields_of(cls: type, record: dict) -> dict:
    """The recorded values of ``cls``'s fields (lists back to tuples), except nested runs."""
    names = {f.name for f in dataclasses.fields(cls)} - {"runs", "command"}
    return {k: tuple(v) if isinstance(v, list) else v for k, v in record.items() if k in names}


def run_python(code: str, name: str) -> str:
    """The stdout of ``code`` run as ``NAME.py`` in a temporary directory; again if it left files
    there (checkpoints): an example a reader runs again in the same folder must print the same."""
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / f"{name}.py"
        script.write_text(code)
        outputs = []
        for run in ("first", "second"):
            done = subprocess.run(
                [sys.executable, script.name], cwd=tmp, capture_output=True, text=True, timeout=900
            )
            if done.returncode != 0:
                raise ExampleError(
                    f"the Python example {name!r} exited {done.returncode} on its {run} run in one folder: "
                    f"{done.stderr[-3000:]}"
                )
            outputs.append(done.stdout)
            left = {p.name for p in Path(tmp).iterdir()} - {script.name, "__pycache__"}
            if not left:  # nothing of its own in the folder: a second run would meet what the first did
                break
    if masked(outputs[0]) != masked(outputs[-1]):
        raise ExampleError(f"the Python example {name!r} printed otherwise when run again in the same folder")
    return outputs[0]


def abridge(output: str, options: str) -> str:
    """Apply a block's options to its output: ``from "TEXT"`` keeps the lines from the first that
    starts with TEXT, ``until "TEXT"`` those before the first (after that) that starts with TEXT;
    ``...`` stands for what is left out."""
    lines = output.splitlines()
    start, end = 0, len(lines)
    for option in (o.strip() for o in options.split("; ") if o.strip()):
        match = re.fullmatch(r'(?P<kind>from|until) "(?P<text>[^"]+)"', option)
        if not match:
            raise ExampleError(f'unknown option {option!r}; give from "TEXT" or until "TEXT"')
        found = next((i for i in range(start, end) if lines[i].startswith(match["text"])), None)
        if found is None:
            raise ExampleError(f"no line of the output starts with {match['text']!r}")
        if match["kind"] == "from":
            start = found
        else:
            end = found
    kept = lines[start:end]
    while kept and not kept[-1].strip():
        kept.pop()
    return "\n".join(["..."] * (start > 0) + kept + ["..."] * (end < len(lines))) + "\n"


def render_example(spec: str, sources: dict[str, str]) -> str:
    """The output a block's spec stands for (without the fence)."""
    command, _, option = spec.partition("; ")
    words = shlex.split(command)
    if words[:1] == ["vlmcompile"]:
        output = run_cli(words[1:])
    elif words[:2] == ["recorded", "vlmcompile"] and words[2:3] == ["demo"]:
        output = recorded_demo(words[3:])
    elif words[:1] == ["python"] and len(words) == 2:
        if words[1] not in sources:
            raise ExampleError(f"no <!-- example-source: {words[1]} --> python block in the same file")
        output = run_python(sources[words[1]], words[1])
    else:
        raise ExampleError(
            f"unknown example {command!r}: give `vlmcompile ...`, `recorded vlmcompile demo ...` or `python NAME`"
        )
    output = "\n".join(line.rstrip() for line in output.strip("\n").splitlines()) + "\n"
    return abridge(output, option) if option else output


def fence(output: str) -> str:
    return f"```text\n{output}```\n"


def run_benchmark(script: str, *argv: str) -> str:
    """What ``python benchmarks/SCRIPT ARGV`` prints on stdout, run in this process."""
    module = importlib.import_module(Path(script).stem)
    out = io.StringIO()
    with _quiet_stderr() as written, contextlib.redirect_stdout(out):
        try:
            module.main(list(argv))
        except SystemExit as stop:  # argparse's errors; exit 1 only reports missed goals
            if stop.code not in (None, 0, 1):
                raise ExampleError(
                    f"`python benchmarks/{script} {' '.join(argv)}` exited {stop.code}: {written()[-2000:]}"
                ) from None
    return out.getvalue().strip("\n")


BASELINE_NAMES = {
    "megatron": "Megatron-LM",
    "megatron_balanced": "Megatron-LM balanced",
    "omnibal": "OmniBal",
    "torchtitan_vlm": "torchtitan",
    "mimo_colocated": "Megatron MIMO",
}


def headline() -> str:
    """Three lines of results, each from a results file of benchmarks/, marked measured or simulated."""
    bubbles = [r for r in json.loads((RESULTS / "bubbles.json").read_text())["rows"] if not r.get("frozen")]
    speedups = [min(s for s in r["baselines"].values() if s) / r["ours"] for r in bubbles]
    memory = [r["peak_gib"] / r["frugal_baseline_gib"] for r in bubbles]
    planned = [p for p in bubbles[0]["baselines"] if any(r["baselines"][p] for r in bubbles)]
    unplanned = [p for p in bubbles[0]["baselines"] if p not in planned]
    smallest = min((r["cluster"] for r in bubbles), key=_num_gpus)
    largest = max((r["cluster"] for r in bubbles), key=_num_gpus)
    demo_speedup = importlib.import_module("demo_speedup")
    saved = json.loads((RESULTS / "demo_speedup.json").read_text())
    cap = "0.6"  # each rank held to 60 % of what the whole model needs: as on a GPU
    entry = saved[demo_speedup.entry_key(demo_speedup.BUBBLE_BATCH, cap)]
    summary = demo_speedup.summarize(entry["runs"])
    uncapped_runs = saved[demo_speedup.entry_key(demo_speedup.BUBBLE_BATCH)]["runs"]
    uncapped = demo_speedup.summarize(uncapped_runs)
    # Where ours is Megatron MIMO's own plan in every run, the measured ratio is the noise
    # between two runs of one plan: say so rather than let it read as a speedup or a loss.
    mimo_runs = [r for run in uncapped_runs for r in run["runs"] if r["policy"] == "mimo_colocated"]
    # ours_too: vlmcompile.demo.is_our_plan, recorded with each run (none recorded: not claimed)
    same = bool(mimo_runs) and all(r.get("ours_too", False) for r in mimo_runs)
    uncapped_plan = (
        f"Megatron MIMO's own (data parallelism), measured {uncapped['median_speedup']:.2f}x against it: "
        "the noise between two runs of one plan"
        if same
        else f"data parallelism, {uncapped['median_speedup']:.2f}x"
    )
    not_fitting = ", ".join(BASELINE_NAMES.get(p, p) for p in summary["not_fitting"])
    fidelity = json.loads((RESULTS / "fidelity.json").read_text())
    errors = [
        abs(row[p]["step_error"]) for row in fidelity["rows"] for p in ("megatron", "megatron_balanced")
    ]
    gpus = [row["gpus"] for row in fidelity["rows"]]
    names = ", ".join(BASELINE_NAMES.get(p, p) for p in planned)
    cannot = "".join(f"; {BASELINE_NAMES.get(p, p)} plans no pipeline" for p in unplanned)
    return "\n".join(
        [
            f"* **Simulated:** our plan's training step is {min(speedups):.2f}-{max(speedups):.2f}x faster than "
            f"the best baseline at the same parallel degrees ({names}{cannot}) on all {len(bubbles)} setups of "
            f"the Optimus paper, {_gpus(smallest)} to {_gpus(largest)}, holding {min(memory):.2f}-{max(memory):.2f}x "
            "the peak memory of the most frugal baseline. `python benchmarks/bubbles.py`",
            f"* **Measured:** on 2 CPU ranks the `demo` VLM at global batch {demo_speedup.BUBBLE_BATCH}, each rank "
            f"held to {100 * float(cap):.0f} % of the memory the whole model needs ({not_fitting or 'no baseline'} then does not fit), trains "
            f"{summary['median_speedup']:.2f}x as fast as the fastest baseline that fits (median of "
            f"{len(entry['runs'])} runs, {summary['min_speedup']:.2f}-{summary['max_speedup']:.2f}x), every loss "
            + ("equal to eager PyTorch's" if summary["all_equal_to_eager"] else "NOT always equal to eager's")
            + f"; uncapped, our plan is {uncapped_plan}. `{entry['command']}`",
            f"* **Simulated, against measured:** the simulator's step times for Megatron-LM's two plans of "
            f"ViT-22B + GPT-175B on {min(gpus)}-{max(gpus)} H100s are within {100 * max(errors):.1f} % of the "
            f"steps the Optimus paper measured (its Table 5). `{fidelity['command']}`",
        ]
    )


def _num_gpus(cluster: str) -> int:
    return int(re.search(r"x(\d+)$", cluster)[1])


def _gpus(cluster: str) -> str:
    family = re.match(r"[a-z]+\d*", cluster)[0].upper()
    return f"{_num_gpus(cluster)} {family}s"


GENERATED: dict[str, Callable[[], str]] = {
    "headline": headline,
    **{name: (lambda cmd=cmd: run_benchmark(*cmd)) for name, cmd in RERENDERED.items()},
}
"""Every section this script writes."""


# ---- comparing and rewriting -----------------------------------------------------------------
def masked(text: str) -> str:
    """``text`` with :data:`MASKS` applied and runs of spaces and table rules collapsed."""
    for pattern, replacement in MASKS:
        text = pattern.sub(replacement, text)
    text = re.sub(r"-{3,}", "---", text)
    text = re.sub(r"[ \t]+", " ", text)
    return "\n".join(line.strip() for line in text.strip().splitlines())


@dataclass
class Block:
    path: Path
    line: int
    kind: str
    """``example`` or ``section``."""
    spec: str
    current: str
    """The block's content now (for an example, the fenced output)."""
    fresh: str | None = None
    error: str | None = None
    seconds: float = 0.0

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def stale(self) -> bool:
        return self.error is None and masked(self.current) != masked(self.fresh)

    def diff(self, limit: int = 30) -> str:
        lines = list(
            difflib.unified_diff(
                masked(self.current).splitlines(),
                masked(self.fresh).splitlines(),
                "in the file",
                "now",
                lineterm="",
            )
        )
        return "\n".join(lines[:limit] + (["..."] if len(lines) > limit else []))


def find_blocks(path: Path) -> list[Block]:
    body = path.read_text()
    line = lambda offset: body.count("\n", 0, offset) + 1  # noqa: E731
    blocks = [
        Block(path, line(m.start()), "example", m["spec"], _unfence(m["body"]))
        for m in EXAMPLE.finditer(body)
    ]
    for m in SECTION.finditer(body):
        name = m["name"]
        if name in GENERATED and markers(name)[1] in body:
            blocks.append(Block(path, line(m.start()), "section", name, read_section(body, name)))
    return sorted(blocks, key=lambda b: b.line)


def _unfence(body: str) -> str:
    match = re.fullmatch(r"```text\n(?P<text>.*?)```\n?", body, re.S)
    return match["text"] if match else body


def render(blocks: list[Block], *, python: bool) -> list[Block]:
    """Fill in each block's fresh content (or its error); a spec shared by blocks runs once.
    Python examples are left out (not returned) unless ``python``."""
    done: dict[tuple[str, str], tuple[str | None, str | None, float]] = {}
    out = []
    for block in blocks:
        if block.kind == "example" and block.spec.startswith("python ") and not python:
            continue
        key = (block.kind, block.spec)
        if key not in done:
            began = time.perf_counter()
            try:
                if block.kind == "section":
                    fresh = GENERATED[block.spec]()
                else:
                    sources = {m["name"]: m["code"] for m in SOURCE.finditer(block.path.read_text())}
                    fresh = render_example(block.spec, sources)
                done[key] = (fresh, None, time.perf_counter() - began)
            except Exception as err:  # a broken command must not hide the other blocks
                done[key] = (None, f"{type(err).__name__}: {err}", time.perf_counter() - began)
        block.fresh, block.error, block.seconds = done[key]
        out.append(block)
    return out


def rewrite(path: Path, blocks: list[Block]) -> int:
    """Write each stale block of ``path`` in place; returns how many changed."""
    body = original = path.read_text()
    fresh = {
        b.spec: b.fresh for b in blocks if b.path == path and b.kind == "example" and b.fresh is not None
    }

    def example(m: re.Match) -> str:
        spec = m["spec"]
        if spec not in fresh or masked(_unfence(m["body"])) == masked(fresh[spec]):
            return m[0]
        return f"<!-- example: {spec} -->\n{fence(fresh[spec])}<!-- /example -->\n"

    body = EXAMPLE.sub(example, body)
    for b in blocks:
        if b.path == path and b.kind == "section" and b.stale:
            body = replace_section(body, b.spec, b.fresh)
    if body != original:
        path.write_text(body)
    return sum(1 for b in blocks if b.path == path and b.stale)


def collect(only: str | None = None, *, python: bool = False, root: Path = ROOT) -> list[Block]:
    """Every block of README.md and docs/*.md (whose spec contains ``only``), rendered."""
    blocks = [b for p in documents(root) if p.exists() for b in find_blocks(p)]
    if only:
        blocks = [b for b in blocks if only in b.spec]
    return render(blocks, python=python)


def problems(blocks: list[Block]) -> list[str]:
    """One message per block that is stale or could not be rendered."""
    out = []
    for b in blocks:
        if b.error:
            out.append(f"{b.where}: {b.kind} `{b.spec}` could not be rendered: {b.error}")
        elif b.stale:
            out.append(f"{b.where}: {b.kind} `{b.spec}` is stale:\n{b.diff()}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="rewrite nothing; exit 1 if a block is stale")
    parser.add_argument("--only", help="only the blocks whose spec contains this text")
    parser.add_argument("--python", action="store_true", help="also run the Python examples (slow)")
    args = parser.parse_args(argv)
    blocks = collect(args.only, python=args.python)
    for b in blocks:
        state = "error" if b.error else "stale" if b.stale else "up to date"
        print(f"{b.where}: {b.spec} ({state}, {b.seconds:.1f} s)", file=sys.stderr)
    found = problems(blocks)
    if args.check:
        for message in found:
            print(message)
        if found:
            print(f"\n{len(found)} block(s) stale or broken: run python benchmarks/examples.py")
        return 1 if found else 0
    changed = {p: rewrite(p, blocks) for p in {b.path for b in blocks}}
    for path, count in sorted(changed.items()):
        if count:
            print(f"{path.relative_to(ROOT)}: {count} block(s) rewritten")
    errors = [m for m in found if "could not be rendered" in m]
    for message in errors:
        print(message)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
