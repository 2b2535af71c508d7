"""Torch thread counts chosen from the CPUs this process can actually use.

On a machine whose cores are busy with other work, more torch threads than idle cores is the
worst choice: every parallel region ends at a barrier that waits for the thread the kernel has
descheduled (figures: docs/measurements.md, "Figures behind code choices"). ``threads: auto``
therefore takes the number of CPUs that are idle when the process starts, within its affinity
mask, less what its own helper processes will take.
"""

from __future__ import annotations

import math
import os
import time

import torch

from relayrl.config import Threads


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, e.g. a container's cpuset)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _cpu_times() -> tuple[float, float] | None:
    """(idle, total) jiffies of all CPUs from ``/proc/stat``; None where it is unreadable."""
    try:
        with open("/proc/stat") as f:
            fields = [float(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    return idle, sum(fields[:8])  # guest time is already counted in user


def idle_cpus(sample_s: float = 0.2) -> float:
    """Idle CPUs of the machine averaged over ``sample_s`` seconds (CPUs, fractional):
    ``n_online * d_idle / d_total`` between two reads of ``/proc/stat``. Falls back to
    :func:`usable_cpus` where ``/proc/stat`` is unavailable."""
    first = _cpu_times()
    if first is None:
        return float(usable_cpus())
    time.sleep(sample_s)
    second = _cpu_times()
    if second is None or second[1] <= first[1]:
        return float(usable_cpus())
    frac = (second[0] - first[0]) / (second[1] - first[1])
    return frac * (os.cpu_count() or 1)


def resolve_threads(threads: Threads, reserved: int = 0, share: int = 1) -> int:
    """A thread count: ``threads`` itself when it is a number; for ``"auto"``
    ``max(1, (round(min(usable, idle)) - reserved) // share)``, where ``reserved`` CPUs go to
    helper processes this run starts (an engine worker) and ``share`` processes split the rest."""
    if threads != "auto":
        if type(threads) is not int or threads < 1:
            raise ValueError(f"threads must be >= 1 or 'auto' (a whole number), got {threads!r}")
        return threads
    free = math.floor(min(float(usable_cpus()), idle_cpus()) + 0.5)
    return max(1, (free - reserved) // max(share, 1))


def set_threads(threads: Threads, reserved: int = 0, share: int = 1) -> int:
    """``torch.set_num_threads(resolve_threads(...))``; returns the count it set."""
    n = resolve_threads(threads, reserved, share)
    torch.set_num_threads(n)
    return n
