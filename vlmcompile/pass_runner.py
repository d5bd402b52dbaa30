"""Runs a numbered list of passes over one compile state and explains itself.

Prints the pass list, then each pass with its wall time; passes can be disabled by exact
name; a failure is re-raised as :class:`PassError` naming the pass and those already run
(after torch.fx's ``PassManager``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from tabulate import tabulate

from vlmcompile.ir.errors import PassError, VlmCompileError


@dataclass(frozen=True, slots=True)
class Pass:
    name: str
    run: Callable[[Any], None]
    """Reads what it needs from the compile state and writes its result and report back."""


@dataclass(frozen=True, slots=True)
class PassTiming:
    index: int
    name: str
    time_s: float | None
    """None when the pass was disabled."""


@dataclass(frozen=True, slots=True)
class RunReport:
    timings: tuple[PassTiming, ...]

    def __str__(self) -> str:
        rows = [
            [t.index, t.name, "disabled" if t.time_s is None else f"{t.time_s:.2f} s"] for t in self.timings
        ]
        return tabulate(rows, headers=["#", "pass", "time"])


class PassRunner:
    def __init__(
        self, passes: Sequence[Pass], *, disabled: Sequence[str] = (), log: TextIO | None = sys.stderr
    ):
        names = [p.name for p in passes]
        unknown = [d for d in disabled if d not in names]
        if unknown:
            raise VlmCompileError(f"cannot disable unknown pass(es) {unknown}; the passes are {names}")
        self.passes = list(passes)
        self.disabled = set(disabled)
        self.log = log

    def _say(self, text: str) -> None:
        if self.log is not None:
            print(text, file=self.log, flush=True)

    def run(self, state: Any) -> RunReport:
        self._say(
            "passes: "
            + ", ".join(
                f"{i} {p.name}" + (" (disabled)" if p.name in self.disabled else "")
                for i, p in enumerate(self.passes, 1)
            )
        )
        timings: list[PassTiming] = []
        ran: list[str] = []
        for i, p in enumerate(self.passes, 1):
            if p.name in self.disabled:
                timings.append(PassTiming(i, p.name, None))
                continue
            self._say(f"[{i}/{len(self.passes)}] {p.name} ...")
            start = time.perf_counter()
            try:
                p.run(state)
            except VlmCompileError as err:
                # Our own errors already say what to fix: keep their type, add where.
                err.args = (
                    f"{err.args[0] if err.args else err} (in pass {i} '{p.name}'; "
                    f"passes already run: {', '.join(ran) or 'none'})",
                )
                raise
            except Exception as err:
                raise PassError(p.name, i, ran, err) from err
            elapsed = time.perf_counter() - start
            timings.append(PassTiming(i, p.name, elapsed))
            ran.append(p.name)
            self._say(f"[{i}/{len(self.passes)}] {p.name} done in {elapsed:.2f} s")
        return RunReport(tuple(timings))
