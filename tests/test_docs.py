"""README.md and docs/: every printed example is what its command prints now, every generated
section has one home, and every link resolves.

The examples are made by ``python benchmarks/examples.py`` (see its docstring for the block
syntax and the figures masked before comparing); a failure here names the stale block and shows
the difference: run that script and commit what it writes.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"


def _load(name: str):
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(f"_docs_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


examples = _load("examples")
readme_section = _load("readme_section")


def _report(found: list[str]) -> str:
    return "\n\n".join(found) + "\n\nrun: python benchmarks/examples.py"


def test_every_example_and_section_is_current():
    blocks = examples.collect(python=False)
    assert blocks, "no example block found in README.md or docs/"
    found = examples.problems(blocks)
    assert not found, _report(found)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.hf
def test_python_examples_run_and_print_what_the_docs_show():
    pytest.importorskip("transformers")
    blocks = [
        b
        for path in readme_section.documents()
        if path.exists()
        for b in examples.find_blocks(path)
        if b.kind == "example" and b.spec.startswith("python ")
    ]
    assert blocks, "no Python example found"
    found = examples.problems(examples.render(blocks, python=True))
    assert not found, _report(found)


def test_masks_hide_wall_clock_figures_only():
    measured = "step 0.024 s, 337.13 samples/s, 4.4 K tokens/s, MFU 0.7 %; peak memory 0.46 GiB"
    again = "step 0.031 s, 298.00 samples/s, 3.9 K tokens/s, MFU 0.5 %; peak memory 0.47 GiB"
    assert examples.masked(measured) == examples.masked(again)
    simulated = "simulated step: 4044 ms, MFU (model FLOPs) 31.0 %\npeak memory: 53.47 GiB of 74.5 GiB"
    changed = "simulated step: 4045 ms, MFU (model FLOPs) 31.0 %\npeak memory: 53.48 GiB of 74.5 GiB"
    assert examples.masked(simulated) != examples.masked(changed)


def test_every_benchmark_section_has_one_home():
    names = {*examples.RERENDERED, *examples.RUN_ONLY, *examples.GENERATED}
    for script in BENCHMARKS.glob("*.py"):
        for name in re.findall(r'write_readme_section\(\s*f?"([^"]+)"', script.read_text()):
            if "{" in name:  # an f-string: one section per value, e.g. demo_speedup_{batch}
                prefix = name.split("{")[0]
                assert any(n.startswith(prefix) for n in names), (
                    f"{script.name} writes {name}: no such section"
                )
            else:
                names.add(name)
    for name in sorted(names):
        readme_section.section_file(name)  # raises SystemExit naming the files unless exactly one


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_between_documents_resolve():
    broken = []
    for doc in readme_section.documents():
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            file, _, anchor = target.partition("#")
            path = (doc.parent / file).resolve() if file else doc
            if not path.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no file)")
            elif anchor and path.suffix == ".md":
                headings = {_slug(h) for h in re.findall(r"^#+ (.+)$", path.read_text(), flags=re.M)}
                if anchor not in headings:
                    broken.append(f"{doc.relative_to(ROOT)}: {target} (no heading)")
    assert not broken, "\n".join(broken)


def test_quickstart_keeps_the_two_commands_ci_reads():
    lines = (ROOT / "README.md").read_text().splitlines()
    install = lines[lines.index("# install and run the main job") + 1]
    tests = lines[lines.index("# run the tests") + 1]
    assert install.endswith("&& vlmcompile demo"), install
    assert "pytest" in tests, tests


README_MAX_LINES = 250


def test_readme_stays_short():
    """The README says what vlmcompile is and for whom, the two commands, the headline figures,
    the model contract with one example, training, planning at scale, how it works and links;
    every table and long section lives in docs/."""
    count = len((ROOT / "README.md").read_text().splitlines())
    assert count <= README_MAX_LINES, (
        f"README.md has {count} lines, over the limit of {README_MAX_LINES}: move the detail "
        "(tables, long sections, further examples) to a page of docs/ and link it from the README"
    )
