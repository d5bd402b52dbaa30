"""Seconds each test file takes, for ordering the files (tests/conftest.py runs the heaviest first).

Refresh after tests move or grow: run a lane with ``--durations=0`` into a log, then
``python -m tests.durations LOG [LOG ...]``; it rewrites tests/durations.json. Stale figures only
change the order files start in, never what runs.
"""

from __future__ import annotations

import collections
import json
import re
import sys
from pathlib import Path

FILE = Path(__file__).with_name("durations.json")
_LINE = re.compile(r"([0-9.]+)s (?:call|setup|teardown)\s+(\S+?)::")


def weights() -> dict[str, float]:
    """Test file (as pytest names it) -> seconds; empty if the file is missing or damaged."""
    try:
        return {str(k): float(v) for k, v in json.loads(FILE.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def main(logs: list[str]) -> None:
    seconds: collections.Counter = collections.Counter()
    for log in logs:
        for line in Path(log).read_text().splitlines():
            if m := _LINE.match(line):
                seconds[m.group(2)] += float(m.group(1))
    root = FILE.parent.parent
    kept = {k: round(v, 1) for k, v in seconds.most_common() if (root / k).exists()}
    FILE.write_text(json.dumps(kept, indent=1) + "\n")
    print(f"wrote {len(kept)} test files to {FILE}", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
