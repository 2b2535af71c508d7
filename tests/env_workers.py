"""Environments for the worker-process tests (importable by a spawned worker)."""

from __future__ import annotations

import os
import time

from relayrl.env import Environment, StepResult

PIDS_FILE = os.environ.get("RELAYRL_TEST_PIDS", "")


class Spinning(Environment):
    """Rows with ``hang`` spin forever in ``step`` (no await, no sleep: only a kill stops it)."""

    async def reset(self, row):
        self.hang = bool(row.get("hang"))
        if PIDS_FILE:
            with open(PIDS_FILE, "a") as f:
                f.write(f"{os.getpid()}\n")
        return [{"role": "user", "content": row["prompt"]}]

    async def step(self, message):
        if self.hang:
            while True:
                time.sleep(0)  # a busy loop
        return StepResult(done=True, reward=1.0, info={"pid": os.getpid()})


def raising():
    raise RuntimeError("no environment today")
