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


def spinning_agent(base_url, api_key, row):
    """An agent that never returns (a busy loop); rows without ``spin`` make one call."""
    if row.get("spin"):
        while True:
            pass
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    client.chat.completions.create(
        model="p", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    return 0.5
