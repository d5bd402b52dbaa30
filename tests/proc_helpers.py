"""What a process holds, read from Linux's /proc: for tests of what the runtime opens."""

from __future__ import annotations

import os
from pathlib import Path

LOOPBACK = {"0100007F", "00000000000000000000000001000000"}
"""127.0.0.1 and ::1 as /proc/net/tcp{,6} write them (hex, little-endian words)."""
WILDCARD = {"00000000", "00000000000000000000000000000000"}
"""0.0.0.0 and :: (every interface)."""


def listening_sockets(pid: int | str = "self") -> list[tuple[str, int]]:
    """The process's listening TCP sockets as (address in /proc's hex, port)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                address, port = fields[1].split(":")
                out.append((address, int(port, 16)))
    return out
