"""Communication times: ring collectives and point-to-point transfers (alpha-beta model).

A ring over n ranks moves (n - 1) / n of the buffer through every rank's link per phase:
reduce-scatter and all-gather take one phase, all-reduce two (Patarasuk & Yuan 2009; NCCL's
bus-bandwidth convention). Each of the n - 1 steps of a phase pays the link latency once.
Bandwidths are per GPU and per direction (:class:`vlmcompile.Cluster`).
"""

from __future__ import annotations


def _ring_phase_s(nbytes: float, n: int, bw_bytes_per_s: float, latency_s: float) -> float:
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) / n * nbytes / bw_bytes_per_s + (n - 1) * latency_s


def all_reduce_s(nbytes: float, n: int, bw_bytes_per_s: float, latency_s: float) -> float:
    return 2 * _ring_phase_s(nbytes, n, bw_bytes_per_s, latency_s)


def all_gather_s(nbytes: float, n: int, bw_bytes_per_s: float, latency_s: float) -> float:
    """``nbytes`` is the gathered (full) buffer."""
    return _ring_phase_s(nbytes, n, bw_bytes_per_s, latency_s)


def reduce_scatter_s(nbytes: float, n: int, bw_bytes_per_s: float, latency_s: float) -> float:
    """``nbytes`` is the full buffer before scattering."""
    return _ring_phase_s(nbytes, n, bw_bytes_per_s, latency_s)


def p2p_s(nbytes: float, bw_bytes_per_s: float, latency_s: float) -> float:
    if nbytes <= 0:
        return 0.0
    return latency_s + nbytes / bw_bytes_per_s
