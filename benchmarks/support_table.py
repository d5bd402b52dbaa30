"""The table in docs/models.md of supported transformers VLM families, made from the tests.

Runs ``tests/test_transformers_vlms.py`` (about 2 minutes on 2 cores) and reads its JUnit XML:
one row per family, a column per thing the tests check, with what capture recorded (the batch
inputs the graph is specialised on, whether the loss splits over microbatches).

    python benchmarks/support_table.py [--readme]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from readme_section import github_table, write_readme_section  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TESTS = "tests/test_transformers_vlms.py"
COLUMNS = (
    ("test_compiles_for_cpu_ranks_with_its_regions", "{name}", "capture, annotate, plan for cpu:2; regions"),
    ("test_one_step_equals_eager", "{name}-eager", "one step = eager (eager attention)"),
    ("test_one_step_equals_eager", "{name}-sdpa", "one step = eager (SDPA)"),
    (
        "test_compiles_on_meta_for_8_gpus_with_the_real_runs_figures",
        "{name}",
        "meta, h100x8: FLOPs and saved bytes = real",
    ),
)


def run_tests() -> ET.Element:
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", TESTS, "-q", "-p", "no:cacheprovider", f"--junitxml={xml}"]
        cmd += ["-o", "junit_family=legacy"]  # record_property needs it
        subprocess.run(cmd, cwd=ROOT, check=False)
        return ET.parse(xml).getroot()


def table(root: ET.Element) -> tuple[str, int]:
    outcome, props = {}, {}
    for case in root.iter("testcase"):
        failed = case.find("failure") is not None or case.find("error") is not None
        skipped = case.find("skipped") is not None
        outcome[case.get("name")] = "fails" if failed else "skipped" if skipped else "yes"
        props[case.get("name")] = {p.get("name"): p.get("value") for p in case.iter("property")}
    names = sorted(
        {
            m.group(1)
            for n in outcome
            if (m := re.match(r"test_compiles_for_cpu_ranks_with_its_regions\[(.+)\]", n))
        }
    )
    header = [
        "family",
        "transformers class",
        *(c[2] for c in COLUMNS),
        "specialised on",
        "loss over microbatches",
    ]
    body = []
    bad = 0
    for name in names:
        facts = props.get(f"test_compiles_for_cpu_ranks_with_its_regions[{name}]", {})
        cells = [outcome.get(f"{test}[{case.format(name=name)}]", "not run") for test, case, _ in COLUMNS]
        bad += sum(c != "yes" for c in cells)
        body.append(
            [
                name,
                facts.get("model_class", "?"),
                *cells,
                facts.get("specialised") or "-",
                facts.get("loss_split", "?"),
            ]
        )
    return github_table(header, body), bad


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--readme", action="store_true", help="write its table (README.md or docs/)")
    args = parser.parse_args()
    text, bad = table(run_tests())
    text += f"\n\nMade by `python benchmarks/support_table.py --readme` from `{TESTS}`."
    print(text)
    if args.readme:
        write_readme_section("transformers_support", text)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
