"""Issue 43, item 4, vLLM's GPU weight-transfer engines (``relayrl.rollout.vllm_gpu_sync``):
every push is bounded by ``weight_sync.timeout_s``. NCCL / CUDA IPC need a GPU, so the bound
is tested on the CPU with the transfer injected: one that streams the weights into a real
process (this test's receiver, over a pipe) and waits for its acknowledgement, the shape of a
transfer engine's send. The receiver hangs (alive, reads, never answers) or dies mid-transfer;
each push ends within timeout + slack in a ``GpuWeightSyncError`` of one line naming the
engine, the backend and the version, and the sync refuses every later push (the engine may
hold a half-updated model). Never a ratio of two timings."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest
import torch

from relayrl.rollout.vllm_gpu_sync import GpuWeightSync, GpuWeightSyncError
from relayrl.rollout.vllm_server_process import VllmServerError

TIMEOUT_S = 2.0
SLACK_S = 30.0

RECEIVER = r"""
import os, sys, time
mode = sys.argv[1]
pushes = 0
while True:
    n = int(sys.stdin.buffer.readline())
    pushes += 1
    got = 0
    while got < n:
        chunk = sys.stdin.buffer.read(min(1 << 16, n - got))
        got += len(chunk)
        if mode == "die" and pushes == 2 and got >= n // 2:
            os._exit(3)  # dies in the middle of the second transfer
    if mode == "hang" and pushes == 2:
        time.sleep(600)  # alive, took the bytes, never acknowledges
    sys.stdout.write("ok\n")
    sys.stdout.flush()
"""


@dataclass
class PipeTrainerInitInfo:
    """The injected transfer's init info (its name gives the backend: ``pipe``)."""


class PipeTransfer:
    """A transfer into a receiver process: every parameter's bytes, then wait for ``ok``
    (what vLLM's ``send_weights`` does over NCCL / IPC: send, then the receiver's finish)."""

    def __init__(self, model: torch.nn.Module, mode: str) -> None:
        self.model = model
        self.proc = subprocess.Popen(
            [sys.executable, "-c", RECEIVER, mode],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        self.pushes = 0

    def send_weights(self) -> None:
        self.pushes += 1
        assert self.proc.stdin is not None and self.proc.stdout is not None
        data = b"".join(p.detach().numpy().tobytes() for p in self.model.parameters())
        self.proc.stdin.write(f"{len(data)}\n".encode() + data)
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if answer != b"ok\n":
            raise ConnectionError(f"receiver gave {answer!r} (exit code {self.proc.poll()})")

    def shutdown(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)


@pytest.fixture
def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 64))


def _sync(model: torch.nn.Module, mode: str) -> GpuWeightSync:
    transfer = PipeTransfer(model, mode)
    return GpuWeightSync(None, model, PipeTrainerInitInfo(), TIMEOUT_S, trainer=transfer)


def test_a_receiver_that_answers_takes_every_push(model):
    sync = _sync(model, "ok")
    try:
        sync.push(1)
        sync.push(2)
        assert sync.trainer.pushes == 2 and sync.broken is None
    finally:
        sync.close()


@pytest.mark.parametrize("mode", ["hang", "die"])
def test_a_receiver_that_hangs_or_dies_is_an_error_within_the_bound(model, mode):
    """The receiver takes version 1, then in version 2's push it hangs (the push passes
    timeout_s) or exits mid-transfer (exit code 3: the push fails at once). Both within
    timeout + slack, one line naming the engine, the backend and the version; a later push
    is refused without touching the transfer; the error is a VllmServerError (a server engine
    then refuses every request)."""
    sync = _sync(model, mode)
    sync.push(1)
    t0 = time.monotonic()
    with pytest.raises(GpuWeightSyncError) as info:
        sync.push(2)
    assert time.monotonic() - t0 < TIMEOUT_S + SLACK_S
    first = info.value
    try:
        msg = str(first)
        assert isinstance(first, VllmServerError) and "\n" not in msg
        assert msg.startswith("pipe weight update to version 2 of the in-process vLLM engine (pid ")
        assert "(weight_sync.timeout_s=2)" in msg and "half-updated model" in msg
        if mode == "hang":
            assert "TimeoutError: no answer within 2 s" in msg
        else:
            assert re.search(r"(BrokenPipe|Connection)Error", msg), msg  # write or read
        pushes = sync.trainer.pushes
        t0 = time.monotonic()
        with pytest.raises(GpuWeightSyncError) as again:
            sync.push(3)
        assert str(again.value) == msg and sync.trainer.pushes == pushes
        assert time.monotonic() - t0 < SLACK_S
    finally:
        sync.close()
