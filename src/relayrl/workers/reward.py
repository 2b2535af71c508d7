"""Reward role: decode completions and score them with a reward function.

A function with a ``score_batch(prompts, completions, samples)`` method (a model-based
scorer such as ``relayrl.reward.service.rm_scorer.RewardModelScorer``) is called once per batch
instead.

Scores here are the raw verifiable outcome (the contract for filters and pass rates); shaping
and KL penalties are applied by the algorithm afterwards.

With a ``RewardService`` (``reward.service`` in the config) the service scores instead: the
score is the weighted mixture (z-scored per domain within the batch when ``normalize`` is
``domain_zscore``), every component is logged, failures are recorded, and the raw outcome is
on each sample as ``sample.metadata["reward"]["outcome"]``.

A reward function that raises (inline; ``SystemExit`` too, as in the service) scores 0 with
the error in ``sample.metadata["reward"]["error"]``, as a failed call of the service is
recorded: the controller then leaves the sample out of training
(``relayrl.controller.failures``).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch
from torch import Tensor

from relayrl.reward import (
    BatchScorer,
    RewardFunctionError,
    RewardService,
    batch_reward_stats,
    score,
    zscore_by_domain,
)
from relayrl.reward.functions import fn_name
from relayrl.rollout.types import Sample


class RewardWorker:
    """The reward role (a :class:`~relayrl.reward.Scorer`): see the module."""

    def __init__(
        self,
        fn: Callable[..., Any],
        tokenizer: Any,
        service: RewardService | None = None,
        normalize: str = "none",
        domain_key: str = "domain",
        timeout_s: float | None = None,
    ):
        self.fn = fn
        self.tokenizer = tokenizer
        self.service = service
        self.normalize = normalize
        self.domain_key = domain_key
        self.timeout_s = timeout_s
        """Seconds one inline call of ``fn`` may take (``reward.fn_timeout_s``; None: no limit);
        past it, :class:`RewardFunctionError` (the call is abandoned on its daemon thread)."""
        self._caller: _DaemonCaller | None = None
        self.scored = 0
        """Samples scored inline so far (a stall watchdog's progress: :meth:`progress`)."""

    def progress(self) -> int:
        """Samples scored so far, inline or by the service (counts that only grow; read from
        another thread by ``controller.watchdog``)."""
        if self.service is None:
            return self.scored
        return self.scored + int(self.service.stats()["reward_service/completed"])

    def _score_with_service(self, samples: Sequence[Sample]) -> tuple[Tensor, dict[str, float]]:
        assert self.service is not None
        results = self.service.score_batch(samples)
        domains = [s.metadata.get(self.domain_key) for s in samples]
        values = [r.score for r in results]
        if self.normalize == "domain_zscore":
            values = _zscore_scored(values, [r.failed for r in results], domains)
        stats = batch_reward_stats(
            results, domains if any(d is not None for d in domains) else None
        )
        return torch.tensor(values, dtype=torch.float32), stats

    def renormalize(self, samples: Sequence[Sample], left_out: Sequence[bool]) -> Tensor | None:
        """With ``domain_zscore``: the scores of ``samples`` z-scored again as one batch from
        the raw scores the service recorded on them (``metadata["reward"]``), over the samples
        neither ``left_out`` (the controller's infrastructure failures: an aborted request,
        a failed episode) nor failed in the reward call; so that samples scored in separate
        calls (a retry, a regenerated group) share their batch's domain statistics, as a clean
        batch scored at once would. None when there is nothing to redo (no service, no
        normalisation)."""
        if self.service is None or self.normalize != "domain_zscore":
            return None
        recorded = [s.metadata.get("reward") or {} for s in samples]
        values = [float(r.get("score", 0.0)) for r in recorded]
        failed = [
            out or bool(r.get("error")) or "score" not in r
            for r, out in zip(recorded, left_out, strict=True)
        ]
        domains = [s.metadata.get(self.domain_key) for s in samples]
        return torch.tensor(_zscore_scored(values, failed, domains), dtype=torch.float32)

    def outcomes(self, samples: Sequence[Sample], scores: Tensor) -> Tensor:
        """The raw verifiable outcome per sample (for pass rates and filters): the service's
        recorded outcome when it scored them, else the score itself."""
        if self.service is None:
            return scores
        out = [
            float(s.metadata.get("reward", {}).get("outcome", sc))
            for s, sc in zip(samples, scores.tolist(), strict=True)
        ]
        return torch.tensor(out, dtype=torch.float32)

    def finish(self, samples: Sequence[Sample], scores: Tensor) -> Tensor:
        """The service's scores as they are (single-turn samples: nothing to add)."""
        return scores

    def close(self) -> None:
        if self.service is not None:
            self.service.close()

    def decode(self, sample: Sample) -> str:
        return self.tokenizer.decode(sample.response_ids, skip_special_tokens=True)

    def score(self, samples: Sequence[Sample]) -> tuple[Tensor, dict[str, float]]:
        """Score each sample (its ``metadata`` holds prompt, answer and extra fields).

        Returns the per-sample scores [B] and batch means of every named component.
        """
        if self.service is not None:
            return self._score_with_service(samples)
        scores = torch.zeros(len(samples), dtype=torch.float32)
        comp_sums: dict[str, float] = {}
        fields = [dict(s.metadata) for s in samples]
        prompts = [str(f.get("prompt", "")) for f in fields]
        completions = [self.decode(s) for s in samples]
        if isinstance(self.fn, BatchScorer):  # model-based scorer: one batched call
            try:
                batch = self.fn.score_batch(prompts, completions, fields)
                outs = [_as_components(r) for r in batch]
            except (Exception, SystemExit) as e:  # an infrastructure failure of every sample
                outs = [self._failed(s, e) for s in samples]
            self.scored += len(samples)
        else:
            outs = []
            for s, p, c, f in zip(samples, prompts, completions, fields, strict=True):
                outs.append(self._score_one(s, p, c, f))
                self.scored += 1
        for i, out in enumerate(outs):
            scores[i] = out["score"]
            for k, v in out.items():
                comp_sums[k] = comp_sums.get(k, 0.0) + float(v)
        n = max(len(samples), 1)
        return scores, {f"reward/{k}": v / n for k, v in comp_sums.items()}

    def _score_one(
        self, sample: Sample, prompt: str, completion: str, fields: dict[str, Any]
    ) -> dict[str, float]:
        try:
            return self._score(prompt, completion, fields)
        except (Exception, SystemExit) as e:  # raised, exited, broke the contract, timed out
            return self._failed(sample, e)

    def _failed(self, sample: Sample, exc: BaseException) -> dict[str, float]:
        """A reward function that raised: score 0, and the error recorded on the sample as the
        reward service records it (``metadata["reward"]["error"]``), so that the controller
        leaves the sample out of training (``relayrl.controller.failures``), whichever path
        scored it. Only its first line: a traceback belongs in ``--debug``."""
        first = (str(exc).strip().splitlines() or [""])[0]
        if first.startswith("reward function "):  # the contract's or the timeout's own line
            error = first[:500]
        else:
            error = f"reward function {fn_name(self.fn)} raised {type(exc).__name__}: {first}"
            error = error[:500]
        sample.metadata["reward"] = {"score": 0.0, "outcome": 0.0, "error": error}
        return {"score": 0.0}

    def _score(self, prompt: str, completion: str, sample: dict) -> dict[str, float]:
        if self.timeout_s is None:
            return score(self.fn, prompt, completion, sample)
        if self._caller is None:
            self._caller = _DaemonCaller()
        try:
            return self._caller.call(self.timeout_s, score, self.fn, prompt, completion, sample)
        except TimeoutError:
            self._caller = None  # its thread is stuck in the call: a fresh one next time
            raise RewardFunctionError(
                f"reward function {fn_name(self.fn)} did not return within {self.timeout_s:g} s "
                "(reward.fn_timeout_s)"
            ) from None


class _DaemonCaller:
    """Calls functions on one daemon thread, waiting at most a timeout for each: a call that
    hangs is abandoned there and never keeps the process from exiting."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Any, tuple[Any, ...], Future[Any]]] = (
            queue.SimpleQueue()
        )
        threading.Thread(target=self._loop, name="reward-fn", daemon=True).start()

    def _loop(self) -> None:
        while True:
            fn, args, future = self._jobs.get()
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # handed to the caller
                future.set_exception(exc)

    def call(self, timeout_s: float, fn: Any, *args: Any) -> Any:
        future: Future[Any] = Future()
        self._jobs.put((fn, args, future))
        return future.result(timeout=timeout_s)


def _zscore_scored(values: list[float], failed: list[bool], domains: list[Any]) -> list[float]:
    """``values`` z-scored within each domain over the samples that scored (``zscore_by_domain``);
    a failed call keeps its failure score and is out of its domain's mean and std (its score
    is no outcome, and the sample itself is left out of training)."""
    out = list(values)
    ok = [i for i, f in enumerate(failed) if not f]
    z = zscore_by_domain([values[i] for i in ok], [domains[i] for i in ok])
    for i, v in zip(ok, z, strict=True):
        out[i] = v
    return out


def _as_components(result: Any) -> dict[str, float]:
    """A batch scorer's per-sample result (float, or dict with a ``"score"``) as components."""
    if isinstance(result, dict):
        if "score" not in result:
            raise TypeError(f"returned {result!r:.120}: a dict needs a 'score'")
        return {str(k): float(v) for k, v in result.items()}
    return {"score": float(result)}
