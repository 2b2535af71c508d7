"""Infrastructure failures are never training data (docs/failures.md).

Two kinds of failure:

- a *model failure* is the policy's own doing and keeps its score (a wrong answer, a program
  that crashes in the sandbox on its own code, malformed tool-call JSON, an episode that
  overruns the context): it trains as scored;
- an *infrastructure failure* is not: an environment that raises or hangs in reset / step
  (``env`` / ``env_timeout``), an agent function that crashes or hangs (``agent`` /
  ``agent_timeout``), an engine that aborts or rejects a request or a turn of an episode
  (``engine``: a single-turn sample whose ``finish_reason`` is ``'abort'``, or an episode
  that stopped ``abort``), a reward function that raises (``reward_fn``), a reward worker
  that dies (``reward_worker``) or times out (``reward_timeout``), a code sandbox that cannot
  start a program (``sandbox``). Its score (0) would be a lie.

:func:`classify` reads which from what the lower layers already record on the sample
(``metadata["env"]`` of an episode, ``metadata["reward"]["error"]`` of the inline reward
worker and of the reward service alike) and :func:`tag` writes it on the sample as
``metadata["failure"] = {"kind", "cause", "error"}``.

The sync schedule generates and scores an infrastructure-failed sample again, same request and
seed, a fresh environment, up to ``failures.retries`` times (:func:`retry_failed`). What still
fails is left out of the batch by :meth:`FailureLog.admit`, so it is out of its group's mean and
standard deviation (every estimator's baseline is over the survivors) and out of the loss
normaliser. A group left with fewer than 2 samples (:func:`small_groups`; GRPO-style
estimators) is regenerated with a fresh prompt in the sync schedule, up to
``failures.regenerate_rounds`` times, by the rule dynamic sampling refills with
(``controller.dynamic_sampling.regenerate_small_groups``); one still too small is dropped.
Each step's ``metrics.jsonl`` record counts them: ``failures/infra/<cause>``,
``failures/infra``, ``failures/retried``, ``failures/groups_regenerated``,
``failures/groups_dropped``. A run whose failures pass the budget (``failures.max_consecutive``
in a row, more than ``failures.max_rate`` of the last ``failures.window`` samples, or a step of
which nothing survives) stops with :class:`InfraBudgetExceeded`: one line naming the dominant
cause and its last error (the trainer appends the newest intact checkpoint; exit 1).
"""

from __future__ import annotations

import dataclasses
from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from relayrl.config.failures import FailuresConfig
from relayrl.controller.faults import RunFault
from relayrl.controller.watchdog import no_mark
from relayrl.env.scoring import env_info
from relayrl.rollout.types import GenerationRequest, Sample

INFRA = "infra"
MODEL = "model"
FAILURE_KEY = "failure"
RETRIED_KEY = "retried"
"""``metadata["retried"]``: the infrastructure failures a sample's request was generated again
after below the controller, ``[{"cause", "error"}]`` (a lost Ray replica: ``replica_lost``)."""
MODEL_STOPS = ("context_overflow",)
"""Episode stop reasons that are the policy's doing: the sample keeps its score and trains."""

__all__ = [
    "FailureLog",
    "InfraBudgetExceeded",
    "classify",
    "fresh_request",
    "infra_cause",
    "note_retry",
    "renormalized",
    "retry_failed",
    "small_groups",
    "tag",
]


class InfraBudgetExceeded(RunFault):
    """Too many infrastructure failures: the run stops (one line, exit 1)."""


def classify(sample: Sample) -> tuple[str, str, str] | None:
    """``(kind, cause, error)`` of a failed sample, None for one that did not fail."""
    info = env_info(sample)
    if info is not None:
        reason, error = str(info["stop_reason"]), str(info.get("error") or "")
        agent = error.startswith("the agent")
        if reason == "env_error":
            return INFRA, "agent" if agent else "env", error or "the environment failed"
        if reason == "timeout":
            return INFRA, "agent_timeout" if agent else "env_timeout", error or "timed out"
        if reason == "abort":
            return INFRA, "engine", error or "the engine aborted the episode"
        if reason in MODEL_STOPS:
            return MODEL, reason, error or reason
    elif sample.finish_reason == "abort" or sample.error is not None:
        # a single-turn request the engine aborted (a server that dropped it, an abort) or
        # refused: its tokens, if any, are an interrupted generation, whatever it scored
        return INFRA, "engine", sample.error or "the engine aborted the request"
    reward = sample.metadata.get("reward")
    if isinstance(reward, dict) and reward.get("error"):
        error = str(reward["error"])
        if error.startswith("timeout"):
            return INFRA, "reward_timeout", error
        if "worker died" in error or "service closed" in error:
            return INFRA, "reward_worker", error
        if "SandboxUnavailable" in error:
            return INFRA, "sandbox", error
        return INFRA, "reward_fn", error
    return None


def infra_cause(sample: Sample) -> str | None:
    """The cause of an infrastructure failure, None for a sample that trains."""
    kind = classify(sample)
    return kind[1] if kind is not None and kind[0] == INFRA else None


def tag(sample: Sample) -> tuple[str, str, str] | None:
    """:func:`classify` written on the sample as ``metadata["failure"]`` (kept when None)."""
    kind = classify(sample)
    if kind is not None:
        sample.metadata[FAILURE_KEY] = {"kind": kind[0], "cause": kind[1], "error": kind[2]}
    return kind


def note_retry(metadata: dict[str, Any], cause: str, error: str) -> dict[str, Any]:
    """``metadata`` with the infrastructure failure ``cause`` (``error``: one line) appended to
    its ``retried`` list: what a backend that generates a request again on its own (a Ray
    replica that died with it in flight) tags the request with. The sample trains (its retry
    succeeded) and :meth:`FailureLog.admit` counts it in ``failures/retried/<cause>``."""
    done = list(metadata.get(RETRIED_KEY) or [])
    done.append({"cause": cause, "error": " ".join(error.split())[:300]})
    return {**metadata, RETRIED_KEY: done}


def fresh_request(req: GenerationRequest) -> GenerationRequest:
    """``req`` again, without what its failed attempt recorded in the shared metadata."""
    drop = ("reward", "env", FAILURE_KEY, RETRIED_KEY)
    meta = {k: v for k, v in req.metadata.items() if k not in drop}
    return dataclasses.replace(req, metadata=meta)


def retry_failed(
    rollout: Any,
    reward: Any,
    requests: Sequence[GenerationRequest],
    samples: list[Sample],
    scores: Tensor,
    retries: int,
    mark: Callable[[str], None] = no_mark,
) -> tuple[list[Sample], Tensor, int]:
    """Generate and score the infrastructure-failed samples again (same request and seed; an
    episode gets a fresh environment: a failed one is never reused), up to ``retries`` rounds.
    Returns the samples, their scores and how many attempts were retried. ``mark``: each
    phase, for a stall watchdog (``controller.watchdog``)."""
    samples, scores, retried = list(samples), scores.clone(), 0
    for r in range(retries):
        bad = [i for i, s in enumerate(samples) if infra_cause(s) is not None]
        if not bad:
            break
        mark(f"retry {r + 1} of {retries}: generating {len(bad)} failed samples again")
        again = rollout.generate([fresh_request(requests[i]) for i in bad])
        mark(f"retry {r + 1} of {retries}: scoring {len(again)} samples")
        new_scores, _ = reward.score(again)
        for j, i in enumerate(bad):
            samples[i] = again[j]
            scores[i] = new_scores[j]
        retried += len(bad)
    return samples, scores, retried


def renormalized(reward: Any, samples: Sequence[Sample], scores: Tensor) -> Tensor:
    """``scores`` normalised again as one batch when the reward role normalises per batch
    (``domain_zscore``: ``RewardWorker.renormalize``), over the samples that are no
    infrastructure failure: a failure's score moves no other sample's, and samples scored in
    separate calls (a retry, a regenerated group) score as in a clean batch scored at once.
    ``scores`` unchanged otherwise."""
    redo = getattr(reward, "renormalize", None)
    if redo is None:
        return scores
    again = redo(samples, [infra_cause(s) is not None for s in samples])
    return scores if again is None else again


def small_groups(samples: Sequence[Sample], min_group: int = 2) -> list[Any]:
    """The groups (ids, in order of first appearance) that lost samples to infrastructure
    failures and have fewer than ``min_group`` left: n_left < n and n_left < min_group."""
    size: Counter[Any] = Counter(s.group_id for s in samples)
    left: Counter[Any] = Counter(s.group_id for s in samples if infra_cause(s) is None)
    return [g for g in size if g is not None and left[g] < size[g] and left[g] < min_group]


class FailureLog:
    """The run's failure counts, its budget, and the filter that keeps failures out of training.

    One per schedule. :meth:`admit` tags and filters a step's samples; :meth:`metrics` gives
    (and resets) the counts since the last call for the step's record."""

    def __init__(self, cfg: FailuresConfig | None = None, min_group: int = 2) -> None:
        self.cfg = cfg or FailuresConfig()
        self.min_group = min_group
        self.recent: deque[bool] = deque(maxlen=self.cfg.window)
        self.in_a_row = 0
        self._peak = 0  # the longest run of failures since the last check
        self.totals: Counter[str] = Counter()  # samples left out, per cause
        self.charged: Counter[str] = Counter()  # failed attempts charged to the budget
        self.retried_causes: set[str] = set()  # ``retried`` tags seen in the run
        self.last_error: dict[str, str] = {}
        self._step: Counter[str] = Counter()

    def count_retries(self, n: int) -> None:
        self._step["retried"] += n

    def count_regenerated(self, n: int) -> None:
        """``failures/groups_regenerated``: groups replaced by a fresh prompt's group."""
        self._step["groups_regenerated"] += n

    def admit(
        self, samples: Sequence[Sample], scores: Tensor, grouped: bool = True
    ) -> tuple[list[Sample], Tensor]:
        """The samples that train and their scores: infrastructure failures left out, and with
        ``grouped`` (group-baseline estimators) groups left with fewer than ``min_group``
        samples too. Raises :class:`InfraBudgetExceeded` past the budget or when nothing is
        left."""
        keep = []
        for i, s in enumerate(samples):
            for retry in s.metadata.get(RETRIED_KEY) or ():
                self.retried_causes.add(retry["cause"])
                self._step[f"retried/{retry['cause']}"] += 1
                self._charge(str(retry["cause"]), str(retry.get("error") or retry["cause"]))
            kind = tag(s)
            failed = kind is not None and kind[0] == INFRA
            self._record(kind if failed else None)
            if not failed:
                keep.append(i)
        self._check(len(samples))
        if grouped and len(keep) < len(samples):
            keep = self._whole_groups(samples, keep)
        if not keep:
            raise InfraBudgetExceeded(f"no sample of the step is left to train: {self._dominant()}")
        if len(keep) == len(samples):
            return list(samples), scores
        index = torch.as_tensor(keep, dtype=torch.long)
        return [samples[i] for i in keep], scores[index]

    def _whole_groups(self, samples: Sequence[Sample], keep: list[int]) -> list[int]:
        """``keep`` less the groups that lost samples and have fewer than ``min_group`` left."""
        small = set(small_groups(samples, self.min_group))
        self._step["groups_dropped"] += len(small)
        return [i for i in keep if samples[i].group_id not in small]

    def _record(self, kind: tuple[str, str, str] | None) -> None:
        self._step["samples"] += 1
        if kind is None:
            self.recent.append(False)
            self.in_a_row = 0
            return
        _, cause, error = kind
        self._charge(cause, error)
        self._step[f"infra/{cause}"] += 1
        self._step["infra"] += 1
        self.totals[cause] += 1

    def _charge(self, cause: str, error: str) -> None:
        """One failed attempt charged to the budget: a sample left out, or an attempt a
        backend generated again on its own (``metadata["retried"]``: a lost Ray replica), in
        the order they happened (the retried attempts before the sample's own outcome)."""
        self.recent.append(True)
        self.in_a_row += 1
        self._peak = max(self._peak, self.in_a_row)
        self.charged[cause] += 1
        self.last_error[cause] = error

    def _check(self, batch: int) -> None:
        c = self.cfg
        peak, self._peak = self._peak, 0
        if peak >= c.max_consecutive:
            why = f"{peak} samples in a row failed (failures.max_consecutive={c.max_consecutive})"
            raise InfraBudgetExceeded(f"{why}: {self._dominant()}")
        failed = sum(self.recent)
        if len(self.recent) == c.window and failed > c.max_rate * c.window:
            why = (
                f"{failed} of the last {c.window} samples failed (failures.max_rate={c.max_rate:g})"
            )
            raise InfraBudgetExceeded(f"{why}: {self._dominant()}")

    def _dominant(self) -> str:
        """``infrastructure failures, mostly <cause> (n of m): last error: ...``."""
        if not self.charged:
            return "no infrastructure failure recorded"
        cause, n = self.charged.most_common(1)[0]
        total = sum(self.charged.values())
        error = " ".join(self.last_error[cause].split())[:300]
        return f"infrastructure failures, mostly {cause} ({n} of {total}); last error: {error}"

    def metrics(self) -> dict[str, float]:
        """``failures/*`` counts since the last call (every cause seen in the run, 0 when none
        this step, so that the series are continuous): ``infra/<cause>`` of the samples left
        out, ``retried/<cause>`` of the samples tagged by :func:`note_retry`."""
        out = {f"failures/infra/{c}": 0.0 for c in self.totals}
        out.update({f"failures/retried/{c}": 0.0 for c in self.retried_causes})
        out.update({f"failures/{k}": float(v) for k, v in self._step.items()})
        out.setdefault("failures/infra", 0.0)
        self._step.clear()
        return out
