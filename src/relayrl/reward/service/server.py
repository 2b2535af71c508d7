"""The reward service: score samples as they finish, off the generation path.

    service = RewardService(RewardMix(["math", {"fn": "format", "weight": 0.1}]),
                            num_workers=4, timeout_s=10, tokenizer=tok)
    fut = service.submit(sample)          # returns at once: a concurrent.futures.Future
    ...
    for sample, result in service.poll(): # finished ones, in completion order
        ...
    results = service.score_batch(samples)  # or: submit all and wait

- Rule-based functions (a ``RewardMix``) run in a pool of ``num_workers`` processes
  (``forkserver`` context on Linux, else ``spawn``: never ``fork`` from a process that holds
  torch threads). Each worker scores one sample at a time, so at most ``num_workers`` calls
  run at once. ``num_workers=0`` scores inline in the caller's thread (no timeouts).
- Per-call timeout: a call still running after ``timeout_s`` is abandoned, its worker
  process killed and replaced; the sample gets the failure score and the reason
  ``"timeout ..."``. A worker that dies (segfault, ``os._exit`` in a reward function) is
  replaced the same way. A function that raises or returns a non-number fails only its own
  component (``RewardMix``). Nothing a reward function does crashes the service.
- Model-based scorers (``score_batch(prompts, completions, samples)``, e.g. a reward model)
  run in this process, one thread each, batched: a batch closes when it holds
  ``model_batch_size`` samples or ``model_max_wait_s`` after its first sample arrived.
- ``max_pending`` bounds the samples in flight: ``submit`` blocks while it is reached
  (back-pressure), or raises ``queue.Full`` with ``block=False``.
- The result is recorded on the sample: ``sample.metadata["reward"] = result.to_dict()``
  (score, components, outcome, error, reason, latency).

Reward functions see ``sample.metadata`` (prompt, answer and the dataset's extra fields) plus
``response_length`` (tokens) and ``finish_reason``.

This module is the public API (submitting, combining the parts, polling, stats, closing); the
process pool is ``relayrl.reward.service.worker_pool`` and the model lanes
``relayrl.reward.service.model_lanes``.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import multiprocessing as mp
import pickle
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import Any, Literal, overload

from relayrl.reward.mixing import RewardMix, ScoreResult
from relayrl.reward.service.guards import MAX_COMPONENTS, call_guarded, checked
from relayrl.reward.service.model_lanes import ModelLane, ModelScorer, run_inline
from relayrl.reward.service.worker_pool import Job, WorkerPool

__all__ = [
    "ModelScorer",
    "RewardService",
    "ServiceClosed",
    "build_reward_service",
    "service_enabled",
]

_LOCAL_KEYS = ("reward",)


class ServiceClosed(RuntimeError):
    """``submit`` after ``close``."""


# ---------------------------------------------------------------------------------------------
# the service


def _default_context() -> str:
    return "forkserver" if sys.platform.startswith("linux") else "spawn"


class RewardService:
    """Scores samples asynchronously (see the module docstring).

    Args:
        reward: the rule-based part: a ``RewardMix``, a spec / list of specs for one, a
            plain picklable callable, or None (model scorers only). An object with
            ``score_batch`` is taken as a model scorer named ``"model"``.
        num_workers: worker processes for the rule-based part (0: inline, no timeouts).
        timeout_s: per-call limit in a worker (None: none).
        max_pending: most samples in flight (None: unbounded).
        tokenizer: decodes ``sample.response_ids`` (``skip_special_tokens=True``) ...
        decode: ... or this callable ``decode(sample) -> str`` does.
        model_scorers: ``(name, scorer, weight)`` triples (or bare scorers, named
            ``model``, ``model2``, ...) added to the mixed score.
        model_batch_size, model_max_wait_s: batching of model scorers.
        failure_score: the score of a failed sample / component.
        mp_context: ``forkserver`` / ``spawn`` (default: forkserver on Linux).
        record_on_sample: write ``sample.metadata["reward"]``.
        worker_max_calls: replace a worker after this many calls (None: never).
        worker_max_rss_mb: replace a worker whose resident memory exceeds this after a call
            (None: never). Both are logged and counted in ``reward_service/worker_recycled``.
        max_components: most components a sample may have; more, or a non-finite total or
            component, makes the sample a recorded failure.
    """

    def __init__(
        self,
        reward: Any = None,
        *,
        num_workers: int = 0,
        timeout_s: float | None = 30.0,
        max_pending: int | None = None,
        tokenizer: Any = None,
        decode: Callable[[Any], str] | None = None,
        model_scorers: Iterable[Any] = (),
        model_batch_size: int = 64,
        model_max_wait_s: float = 0.005,
        failure_score: float = 0.0,
        mp_context: str | None = None,
        record_on_sample: bool = True,
        worker_max_calls: int | None = 5000,
        worker_max_rss_mb: float | None = 1024.0,
        max_components: int = MAX_COMPONENTS,
    ) -> None:
        if worker_max_calls is not None and worker_max_calls < 1:
            raise ValueError(f"worker_max_calls must be >= 1 or None, got {worker_max_calls}")
        if worker_max_rss_mb is not None and worker_max_rss_mb <= 0:
            raise ValueError(f"worker_max_rss_mb must be > 0 or None, got {worker_max_rss_mb}")
        if max_components < 1:
            raise ValueError(f"max_components must be >= 1, got {max_components}")
        self.max_components = int(max_components)
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0 or None, got {timeout_s}")
        if max_pending is not None and max_pending < 1:
            raise ValueError(f"max_pending must be >= 1 or None, got {max_pending}")
        scorers = [_scorer_triple(s, i) for i, s in enumerate(model_scorers)]
        if (
            reward is not None
            and isinstance(reward, ModelScorer)
            and not isinstance(reward, RewardMix)
        ):
            scorers.insert(0, ("model", reward, 1.0))
            reward = None
        if reward is not None and not isinstance(reward, RewardMix):
            if callable(reward) and not isinstance(reward, str):
                reward = RewardMix.from_fn(reward, failure_score=failure_score)
            else:
                reward = RewardMix(reward, failure_score=failure_score)
        if reward is None and not scorers:
            raise ValueError("RewardService needs a reward function or a model scorer")
        names = ([*reward.names] if reward is not None else []) + [n for n, _, _ in scorers]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate reward component names: {names}")
        self.mix: RewardMix | None = reward
        self.failure_score = float(failure_score)
        self.timeout_s = timeout_s
        self.num_workers = num_workers
        self.tokenizer = tokenizer
        self._decode = decode
        self.record_on_sample = record_on_sample
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._completed: collections.deque[tuple[Any, ScoreResult]] = collections.deque()
        self._slots = threading.BoundedSemaphore(max_pending) if max_pending else None
        self._closed = False
        self._counts: collections.Counter[str] = collections.Counter()
        self._latency_sum = 0.0
        self._t_start = time.monotonic()
        self._scorer_weights = {n: w for n, _, w in scorers}
        self._scorers = scorers
        self._lanes: dict[str, ModelLane] = {}
        self._pool: WorkerPool | None = None
        if self.mix is not None and num_workers > 0:
            ctx = mp.get_context(mp_context or _default_context())
            if ctx.get_start_method() == "forkserver":
                with contextlib.suppress(Exception):
                    ctx.set_forkserver_preload(["relayrl.reward.service"])
            try:
                self._pool = WorkerPool(
                    self.mix,
                    num_workers,
                    timeout_s,
                    ctx,
                    self._fn_done,
                    worker_max_calls,
                    worker_max_rss_mb,
                )
            except (TypeError, AttributeError, pickle.PicklingError) as e:
                raise ValueError(
                    "reward functions must be picklable (module-level, or given as "
                    f"'module:function') to run in worker processes: {e}"
                ) from e
        if num_workers > 0:
            for name, scorer, weight in scorers:
                self._lanes[name] = ModelLane(
                    name, scorer, weight, model_batch_size, model_max_wait_s, self._model_done
                )

    # ------------------------------------------------------------------ submitting
    def decode(self, sample: Any) -> str:
        """The completion text of a sample."""
        if self._decode is not None:
            return self._decode(sample)
        if self.tokenizer is not None:
            return self.tokenizer.decode(list(sample.response_ids), skip_special_tokens=True)
        text = getattr(sample, "metadata", {}).get("completion")
        if isinstance(text, str):
            return text
        raise ValueError("RewardService needs a tokenizer or decode= to read samples")

    @staticmethod
    def fields_of(sample: Any) -> dict[str, Any]:
        """What a reward function sees: the sample's metadata (less our own record) plus
        ``response_length`` and ``finish_reason``."""
        meta = getattr(sample, "metadata", None) or {}
        fields = {k: v for k, v in meta.items() if k not in _LOCAL_KEYS}
        ids = getattr(sample, "response_ids", None)
        if ids is not None:
            fields["response_length"] = len(ids)
        reason = getattr(sample, "finish_reason", None)
        if reason is not None:
            fields["finish_reason"] = reason
        return fields

    def submit(
        self, sample: Any, *, block: bool = True, timeout: float | None = None
    ) -> Future[ScoreResult]:
        """Queue a finished sample for scoring; returns a Future of its ``ScoreResult``.

        Decoding problems become a failed result, not an exception. Raises
        ``ServiceClosed`` after ``close``, ``queue.Full`` when ``max_pending`` samples are in
        flight and ``block`` is False (or ``timeout`` passed).
        """
        try:
            completion = self.decode(sample)
            fields = self.fields_of(sample)
            prompt = str(fields.get("prompt", ""))
        except Exception as e:
            return self._submit_failed(sample, f"cannot decode the sample: {e}", block, timeout)
        return self._submit(prompt, completion, fields, sample, block, timeout)

    def submit_text(
        self,
        prompt: str,
        completion: str,
        fields: dict[str, Any] | None = None,
        *,
        block: bool = True,
        timeout: float | None = None,
    ) -> Future[ScoreResult]:
        """Like ``submit`` for text that is already decoded."""
        return self._submit(prompt, completion, dict(fields or {}), None, block, timeout)

    def _acquire(self, block: bool, timeout: float | None) -> bool:
        """Closed check, then one ``max_pending`` slot; True when a slot is held."""
        if self._closed:
            raise ServiceClosed("the reward service is closed")
        if self._slots is None:
            return False
        if not self._slots.acquire(blocking=block, timeout=timeout):
            raise queue.Full("reward service: max_pending samples in flight")
        return True

    def _submit_failed(
        self, sample: Any, error: str, block: bool, timeout: float | None
    ) -> Future[ScoreResult]:
        held = self._acquire(block, timeout)
        job = Job(next(self._ids), "", "", {}, sample, Future(), time.monotonic(), 1)
        job.holds_slot = held
        self._finish(job, ScoreResult.failure(error, self.failure_score))
        return job.future

    def _submit(
        self,
        prompt: str,
        completion: str,
        fields: dict[str, Any],
        sample: Any,
        block: bool,
        timeout: float | None,
    ) -> Future[ScoreResult]:
        held = self._acquire(block, timeout)
        parts = (1 if self.mix is not None else 0) + len(self._scorers)
        job = Job(
            next(self._ids), prompt, completion, fields, sample, Future(), time.monotonic(), parts
        )
        job.holds_slot = held
        with self._lock:
            self._counts["submitted"] += 1
        if self.mix is not None:
            if self._pool is not None:
                self._pool.submit(job)
            else:
                self._fn_done(job, self._inline(prompt, completion, fields))
        for name, scorer, weight in self._scorers:
            if name in self._lanes:
                self._lanes[name].queue.put(job)
            else:
                run_inline(name, scorer, weight, [job], self._model_done)
        return job.future

    def _inline(self, prompt: str, completion: str, fields: dict[str, Any]) -> ScoreResult:
        """The mix in this thread: reward code's SystemExit / KeyboardInterrupt become a
        failure; only a SIGINT the trainer received meanwhile propagates."""
        mix = self.mix
        assert mix is not None
        return call_guarded(lambda: mix(prompt, completion, fields), self.failure_score)

    # ------------------------------------------------------------------ completion
    def _fn_done(self, job: Job, result: ScoreResult) -> None:
        with job.lock:
            job.fn_result = result
            job.parts_left -= 1
            last = job.parts_left == 0
        if last:
            self._combine(job)

    def _model_done(
        self, job: Job, name: str, value: float, extra: dict[str, float], error: str | None
    ) -> None:
        with job.lock:
            job.model_results[name] = (value, extra, error)
            job.parts_left -= 1
            last = job.parts_left == 0
        if last:
            self._combine(job)

    def _combine(self, job: Job) -> None:
        if not self._scorers:
            assert job.fn_result is not None
            self._finish(job, job.fn_result)
            return
        base = job.fn_result
        components = dict(base.components) if base is not None else {}
        total = base.score if base is not None else 0.0
        errors = [base.error] if base is not None and base.error else []
        outcome = base.outcome if base is not None else None
        for name, _, weight in self._scorers:
            value, extra, error = job.model_results[name]
            if error is not None:
                errors.append(error)
                value = self.failure_score
            components[name] = value
            for k, v in extra.items():
                components[f"{name}/{k}"] = v
            total += weight * value
            if outcome is None:
                outcome = value
        components["score"] = total
        self._finish(
            job,
            ScoreResult(
                total,
                components,
                float(outcome if outcome is not None else total),
                "; ".join(errors) or None,
                base.reason if base is not None else None,
                time.monotonic() - job.t_submit,
            ),
        )

    def _finish(self, job: Job, result: ScoreResult) -> None:
        result = checked(result, self.failure_score, self.max_components)
        if self._pool is not None or self._lanes:
            result.latency_s = time.monotonic() - job.t_submit
        if self.record_on_sample and job.sample is not None:
            with contextlib.suppress(Exception):
                job.sample.metadata["reward"] = result.to_dict()
        with self._lock:
            self._counts["completed"] += 1
            self._counts["failed"] += int(result.failed)
            self._latency_sum += result.latency_s
            if job.sample is not None:
                self._completed.append((job.sample, result))
        if job.holds_slot and self._slots is not None:
            job.holds_slot = False
            self._slots.release()
        job.future.set_result(result)

    # ------------------------------------------------------------------ consuming
    def poll(self) -> list[tuple[Any, ScoreResult]]:
        """Samples finished since the last poll (those given to ``submit``), in completion
        order, with their results. Never blocks."""
        with self._lock:
            out = list(self._completed)
            self._completed.clear()
        return out

    def score_batch(self, samples: Sequence[Any]) -> list[ScoreResult]:
        """Score a batch and wait; results in input order. Model scorers see one batch
        (inline mode) or batches of ``model_batch_size`` (pool mode)."""
        if self._pool is None and not self._lanes and len(self._scorers) > 0:
            return self._score_batch_inline(samples)
        futures = [self.submit(s) for s in samples]
        out = [f.result() for f in futures]
        self._drop_polled(samples)
        return out

    def _score_batch_inline(self, samples: Sequence[Any]) -> list[ScoreResult]:
        if self._closed:  # synchronous: nothing stays in flight, so no max_pending slots
            raise ServiceClosed("the reward service is closed")
        jobs: list[Job] = []
        for s in samples:
            parts = (1 if self.mix is not None else 0) + len(self._scorers)
            try:
                completion = self.decode(s)
                fields = self.fields_of(s)
                job = Job(
                    next(self._ids),
                    str(fields.get("prompt", "")),
                    completion,
                    fields,
                    s,
                    Future(),
                    time.monotonic(),
                    parts,
                )
            except Exception as e:
                job = Job(next(self._ids), "", "", {}, s, Future(), time.monotonic(), 1)
                self._finish(
                    job, ScoreResult.failure(f"cannot decode the sample: {e}", self.failure_score)
                )
            jobs.append(job)
        live = [j for j in jobs if not j.future.done()]
        with self._lock:
            self._counts["submitted"] += len(jobs)
        if self.mix is not None:
            for j in live:
                self._fn_done(j, self._inline(j.prompt, j.completion, j.fields))
        for name, scorer, weight in self._scorers:
            run_inline(name, scorer, weight, live, self._model_done)
        self._drop_polled(samples)
        return [j.future.result() for j in jobs]

    def _drop_polled(self, samples: Sequence[Any]) -> None:
        """score_batch hands results back directly: keep them out of ``poll``."""
        ids = {id(s) for s in samples}
        with self._lock:
            self._completed = collections.deque(
                (s, r) for s, r in self._completed if id(s) not in ids
            )

    def stats(self) -> dict[str, float]:
        """Counters: submitted, completed, failed, timeouts, worker restarts, in flight, mean
        latency, worker busy fraction (pool mode)."""
        with self._lock:
            c = dict(self._counts)
            lat = self._latency_sum
        done = c.get("completed", 0)
        out = {
            "reward_service/submitted": float(c.get("submitted", 0)),
            "reward_service/completed": float(done),
            "reward_service/failed": float(c.get("failed", 0)),
            "reward_service/in_flight": float(c.get("submitted", 0) - done),
            "reward_service/latency_s": lat / done if done else 0.0,
        }
        if self._pool is not None:
            elapsed = max(time.monotonic() - self._t_start, 1e-9)
            out["reward_service/timeouts"] = float(self._pool.timeouts)
            out["reward_service/worker_restarts"] = float(self._pool.restarts)
            out["reward_service/worker_recycled"] = float(self._pool.recycled)
            out["reward_service/worker_busy_frac"] = self._pool.busy_seconds() / (
                elapsed * self.num_workers
            )
        return out

    def close(self) -> None:
        """Stop the workers; samples still in flight get a failed result."""
        if self._closed:
            return
        self._closed = True
        left: list[Job] = []
        if self._pool is not None:
            left = self._pool.close()
        for lane in self._lanes.values():
            lane.close()
        for job in left:
            if not job.future.done():
                self._finish(job, ScoreResult.failure("reward service closed", self.failure_score))

    def __enter__(self) -> RewardService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def _scorer_triple(item: Any, i: int) -> tuple[str, Any, float]:
    if isinstance(item, tuple):
        if len(item) != 3:
            raise ValueError(f"model scorer {item!r}: expected (name, scorer, weight)")
        name, scorer, weight = item
    else:
        name, scorer, weight = ("model" if i == 0 else f"model{i + 1}"), item, 1.0
    if not isinstance(scorer, ModelScorer):
        raise TypeError(f"model scorer {name!r} has no score_batch(prompts, completions, samples)")
    return str(name), scorer, float(weight)


def service_enabled(reward_cfg: Any) -> bool:
    """True when a run config's ``reward.service`` section asks for the service (a mixture,
    worker processes, or batch normalisation); otherwise the plain reward path is used."""
    svc = getattr(reward_cfg, "service", None)
    return svc is not None and (
        bool(svc.functions) or svc.num_workers > 0 or svc.normalize != "none"
    )


@overload
def build_reward_service(
    reward_cfg: Any,
    tokenizer: Any = None,
    model_scorers: Iterable[Any] = (),
    *,
    force: Literal[True],
) -> RewardService: ...


@overload
def build_reward_service(
    reward_cfg: Any, tokenizer: Any = None, model_scorers: Iterable[Any] = (), force: bool = False
) -> RewardService | None: ...


def build_reward_service(
    reward_cfg: Any,
    tokenizer: Any = None,
    model_scorers: Iterable[Any] = (),
    force: bool = False,
) -> RewardService | None:
    """The ``RewardService`` of a run config's ``reward`` section (None when the section does
    not enable it, unless ``force``).

    The rule part is ``reward.service.functions`` (a weighted mixture) or else ``reward.fn``
    (unless ``none``); model scorers (a reward model) are passed in by the caller.
    """
    if not force and not service_enabled(reward_cfg):
        return None
    svc = reward_cfg.service
    mix: RewardMix | None
    if svc.functions:
        mix = RewardMix(svc.functions, outcome=svc.outcome, failure_score=svc.failure_score)
    elif reward_cfg.fn and str(reward_cfg.fn).strip().lower() != "none":
        mix = RewardMix([reward_cfg.fn], failure_score=svc.failure_score)
    else:
        mix = None
    return RewardService(
        mix,
        num_workers=svc.num_workers,
        timeout_s=svc.timeout_s,
        max_pending=svc.max_pending,
        tokenizer=tokenizer,
        model_scorers=model_scorers,
        model_batch_size=getattr(reward_cfg, "model_batch_size", 64),
        failure_score=svc.failure_score,
        worker_max_calls=svc.worker_max_calls,
        worker_max_rss_mb=svc.worker_max_rss_mb,
        max_components=svc.max_components,
    )
