"""Issue 43, item 4, the collective transport: a weight sync over the weight group
(``weight_sync.transport: collective``, gloo on CPU) whose peer hangs or never joins is an
error within ``weight_sync.timeout_s`` naming the member and the version, never a hang.

Each test runs one member in this process and the other in a real process of its own
(``tests/support/weight_group_member.py``) that joins and then hangs, or never joins. Bounds are
asserted as "raised within timeout + slack" (slack for a loaded machine), never as a ratio of
two timings.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from relayrl.cluster.weight_collective import (
    WeightGroup,
    WeightSyncError,
    drain,
    entries_of,
    plan_buckets,
)

TIMEOUT_S = 3.0
SLACK_S = 30.0  # a loaded machine: process wake-ups, gloo's own polling
ROOT = Path(__file__).resolve().parents[2]
SUPPORT = ROOT / "tests" / "support"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _member(port: int, rank: int, mode: str) -> subprocess.Popen[str]:
    """The other member in a process of its own, imported (its ``ready`` line read), about to
    join; it waits for the rendezvous far longer than this side's timeout."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(SUPPORT)])}
    args = [str(port), str(rank), "2", mode, str(TIMEOUT_S * 20)]
    proc = subprocess.Popen(
        [sys.executable, str(SUPPORT / "weight_group_member.py"), *args],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.kill()
    proc.wait(timeout=30)


def test_a_replica_that_joins_and_hangs_fails_the_send_within_the_timeout():
    """Trainer rank 0 sends version 7 to a replica that joined the group and then takes part
    in nothing (a live, stuck process): a WeightSyncError within timeout_s + slack naming the
    sender, the replicas it sends to and the version."""
    port = _free_port()
    proc = _member(port, 1, "hang")
    try:
        group = WeightGroup("127.0.0.1", port, 0, 2, "gloo", TIMEOUT_S)
        state = {"w": torch.randn(256), "b": torch.randn(8)}
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError) as info:
            group.send(7, plan_buckets(entries_of(state), 1 << 20), iter(state.items()))
        took = time.monotonic() - t0
        group.close()
    finally:
        _stop(proc)
    msg = str(info.value)
    assert took < TIMEOUT_S + SLACK_S, took
    assert "\n" not in msg and msg.startswith("weight sync of version 7 failed: ")
    assert "trainer rank 0 -> replicas 0..0 (ranks 1..1) sending" in msg
    assert "weight group generation 0" in msg and "(weight_sync.timeout_s=3)" in msg


def test_a_replica_that_never_joins_fails_the_rendezvous_within_the_timeout():
    """Trainer rank 0 forms a group of 2 whose replica died before joining (its process
    started and was killed): a WeightSyncError within timeout_s + slack naming who waited."""
    port = _free_port()
    _stop(_member(port, 1, "hang"))  # a real process that died before the rendezvous
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError) as info:
        WeightGroup("127.0.0.1", port, 0, 2, "gloo", TIMEOUT_S, generation=4)
    took = time.monotonic() - t0
    msg = str(info.value)
    assert took < TIMEOUT_S + SLACK_S, took
    assert "\n" not in msg and msg.startswith("weight sync failed: trainer rank 0 -> replicas")
    assert "joining the group in weight group generation 4" in msg


def test_a_sender_that_hangs_mid_sync_fails_the_receive_within_the_timeout():
    """Replica 0 receives a sync whose sender broadcast the manifest of version 9 and then
    hung: the bucket's receive is a WeightSyncError within timeout_s + slack naming the
    replica, its rank, the bucket and the version; nothing of the bucket is yielded (the
    engine loads nothing of it)."""
    port = _free_port()
    proc = _member(port, 0, "send_hang")
    try:
        group = WeightGroup("127.0.0.1", port, 1, 2, "gloo", TIMEOUT_S)
        version, buckets, parts = group.receive()
        assert version == 9 and [e.name for e in buckets[0]] == ["w"]
        t0 = time.monotonic()
        got = []
        with pytest.raises(WeightSyncError) as info:
            for part in parts:
                got.append(part)
        took = time.monotonic() - t0
        drain(parts)  # a failed stream ends: nothing more comes
        group.close()
    finally:
        _stop(proc)
    msg = str(info.value)
    assert got == [] and took < TIMEOUT_S + SLACK_S, took
    assert "\n" not in msg and msg.startswith("weight sync of version 9 failed: ")
    assert "replica 0 (rank 1) receiving bucket 1 of 1" in msg
