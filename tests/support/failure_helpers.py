"""Components that fail for infrastructure reasons, for tests/integration/test_failures.py: a reward
function that raises on some samples, one that kills its worker, environments that raise or
hang. Importable by name (``failure_helpers:...``) from reward workers and ``env.factory``."""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
from pathlib import Path
from typing import Any

from relayrl.env.builtin.calculator import CalculatorEnv
from relayrl.reward.functions import arithmetic


def _unit(*parts: Any) -> float:
    """A number in [0, 1) fixed by ``parts`` (the same sample always draws the same)."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def flaky_reward(prompt: str, completion: str, sample: dict, rate: float = 0.3) -> float:
    """The arithmetic reward; raises on about ``rate`` of the samples (fixed per sample)."""
    if _unit(prompt, completion, sample.get("sample_index")) < rate:
        raise ConnectionError("verifier backend unreachable")
    return arithmetic(prompt, completion, sample)


def fails_on_prompts(prompt: str, completion: str, sample: dict, rate: float = 0.5) -> float:
    """The arithmetic reward; on the prompts with ``_unit("prompt", prompt) < rate`` (fixed per
    prompt, whatever the completion) every sample but the first (``sample_index`` 0) raises,
    so their groups keep 1 sample. The held-out evaluation's samples (no index) never raise."""
    if sample.get("sample_index", 0) > 0 and prompt_fails(prompt, rate):
        raise ConnectionError("verifier backend unreachable for this problem")
    return arithmetic(prompt, completion, sample)


def prompt_fails(prompt: str, rate: float = 0.5) -> bool:
    """Whether :func:`fails_on_prompts` fails the groups of ``prompt``."""
    return _unit("prompt", prompt) < rate


def broken_reward(prompt: str, completion: str, sample: dict) -> float:
    """A reward function that always raises."""
    raise KeyError("expected_answer")


def dies_after_checkpoint(prompt: str, completion: str, sample: dict, run_dir: str = "") -> float:
    """Kills its reward worker (``os._exit``) once the run wrote checkpoint step 1."""
    if (Path(run_dir) / "checkpoints" / "step_000001").is_dir():
        os._exit(3)
    return arithmetic(prompt, completion, sample)


class FlakyCalculator(CalculatorEnv):
    """The calculator environment; a step raises on ``raise_rate`` of calls and hangs (past
    ``env.step_timeout_s``) on ``hang_rate``, drawn from one seeded stream per process."""

    rng = random.Random(0)

    def __init__(self, raise_rate: float = 0.3, hang_rate: float = 0.0, hang_s: float = 5.0):
        super().__init__(tools=True)
        self.raise_rate, self.hang_rate, self.hang_s = raise_rate, hang_rate, hang_s

    async def step(self, message: Any) -> Any:
        u = FlakyCalculator.rng.random()
        if u < self.raise_rate:
            raise RuntimeError("calculator backend: connection reset")
        if u < self.raise_rate + self.hang_rate:
            await asyncio.sleep(self.hang_s)
        return await super().step(message)


def flaky_calculator(raise_rate: float = 0.3, hang_rate: float = 0.0) -> FlakyCalculator:
    return FlakyCalculator(raise_rate, hang_rate)


def reseed(seed: int) -> None:
    FlakyCalculator.rng.seed(seed)


def hangs(prompt: str, completion: str, sample: dict) -> float:
    """A reward function that never returns in time on a training sample (one with a
    ``sample_index``; the held-out evaluation's are scored at once)."""
    import time

    if "sample_index" in sample:
        time.sleep(60)
    return 0.0


RELEASE = None  # a threading.Event set by a test to let ``blocks`` return


def blocks(prompt: str, completion: str, sample: dict) -> float:
    """A reward function that blocks on a training sample (one with a ``sample_index``) until
    the test sets ``RELEASE`` (at most 60 s); the held-out evaluation's are scored at once."""
    if "sample_index" in sample and RELEASE is not None:
        RELEASE.wait(60)
    return 0.0


def value_or_outage(prompt: str, completion: str, sample: dict) -> float:
    """``sample["value"]``; raises (a verifier outage) on a sample with ``"outage"`` set."""
    if sample.get("outage"):
        raise ConnectionError("verifier backend unreachable")
    return float(sample["value"])


def reports_pid_then_blocks(prompt: str, completion: str, sample: dict, fifo: str = "") -> float:
    """Writes its worker's pid to the named pipe ``fifo``, then blocks (at most 60 s): a test
    kills the worker from outside meanwhile."""
    import threading

    with open(fifo, "w") as f:
        f.write(str(os.getpid()))
    threading.Event().wait(60)
    return 1.0


def exits_on_flagged(prompt: str, completion: str, sample: dict) -> float:
    """1.0; calls ``sys.exit`` (as a verifier library giving up may) on a sample with
    ``"outage"`` set."""
    import sys

    if sample.get("outage"):
        sys.exit("verifier gave up")
    return 1.0


OUTAGES_SEEN: set[Any] = set()


def value_outage_once(prompt: str, completion: str, sample: dict) -> float:
    """``sample["value"]``; the first call on a sample with an ``"outage_once"`` key not seen
    before in this process raises (a verifier outage its retry does not meet)."""
    key = sample.get("outage_once")
    if key is not None and key not in OUTAGES_SEEN:
        OUTAGES_SEEN.add(key)
        raise ConnectionError("verifier backend unreachable")
    return float(sample["value"])


def uneven_fails_on_prompts(prompt: str, completion: str, sample: dict) -> float:
    """:func:`fails_on_prompts`' failures, and a score in [0, 1) fixed by the sample (varied
    within a batch, so that a normalisation of the batch shows)."""
    if sample.get("sample_index", 0) > 0 and prompt_fails(prompt):
        raise ConnectionError("verifier backend unreachable for this problem")
    return _unit(prompt, completion, sample.get("sample_index"))
