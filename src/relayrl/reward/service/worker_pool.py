"""The reward service's process pool: rule-based reward functions in worker processes.

One dispatcher thread feeds ``num_workers`` processes, one sample at a time each, over pipes;
a call still running after ``timeout_s`` has its worker killed and replaced (the sample fails
with ``"timeout ..."``), a worker that dies is replaced the same way, and an idle worker is
recycled after ``max_calls`` calls or above ``max_rss_mb`` resident memory. Three start-up
deaths in a row, or a worker that cannot resolve the functions, break the pool: every pending
and later job fails with the reason. ``RewardService`` (``relayrl.reward.service``) owns it.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from relayrl.reward.mixing import RewardMix, ScoreResult
from relayrl.reward.sandbox import remove_orphaned_dirs
from relayrl.reward.service.guards import call_guarded, checked

log = logging.getLogger(__name__)

__all__ = ["Job", "WorkerPool"]


# ---------------------------------------------------------------------------------------------
# worker process


def _worker_main(conn: Connection, mix: RewardMix) -> None:
    """Pool worker: resolve the functions, then score (id, prompt, completion, fields)
    messages until told to stop (None) or the parent goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business
    try:
        mix.resolve()
    except BaseException as e:
        with contextlib.suppress(Exception):
            conn.send(("init_error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        job_id, prompt, completion, fields = msg
        result = checked(
            call_guarded(functools.partial(mix, prompt, completion, fields), mix.failure_score),
            mix.failure_score,
        )
        try:
            conn.send(("done", job_id, result))
        except Exception as e:  # e.g. an unpicklable component value
            conn.send(
                (
                    "done",
                    job_id,
                    ScoreResult.failure(f"result not sendable: {e}", mix.failure_score),
                )
            )


# ---------------------------------------------------------------------------------------------
# jobs


@dataclass
class Job:
    """One sample in the service: its text, its future, and the parts still to score."""

    id: int
    prompt: str
    completion: str
    fields: dict[str, Any]
    sample: Any
    future: Future
    t_submit: float
    parts_left: int
    fn_result: ScoreResult | None = None
    model_results: dict[str, tuple[float, dict[str, float], str | None]] = field(
        default_factory=dict
    )
    lock: threading.Lock = field(default_factory=threading.Lock)
    holds_slot: bool = False


@dataclass
class _Worker:
    process: Any
    conn: Connection
    ready: bool = False
    job: Job | None = None
    started: float = 0.0
    busy_s: float = 0.0
    calls: int = 0


class WorkerPool:
    """Worker processes fed by one dispatcher thread; per-call deadlines; replacement of
    workers that time out or die."""

    def __init__(
        self,
        mix: RewardMix,
        num_workers: int,
        timeout_s: float | None,
        ctx: Any,
        on_done: Callable[[Job, ScoreResult], None],
        max_calls: int | None = None,
        max_rss_mb: float | None = None,
    ) -> None:
        self.mix = mix
        self.max_calls, self.max_rss_mb = max_calls, max_rss_mb
        self.recycled = 0
        self.timeout_s = timeout_s
        self.ctx = ctx
        self.on_done = on_done
        self.pending: collections.deque[Job] = collections.deque()
        self.lock = threading.Lock()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        self.closed = False
        self.broken: str | None = None
        self.restarts = 0
        self.timeouts = 0
        self.start_failures = 0
        self.workers = [self._spawn() for _ in range(num_workers)]
        self.thread = threading.Thread(target=self._loop, daemon=True, name="reward-dispatch")
        self.thread.start()

    def _spawn(self) -> _Worker:
        parent, child = self.ctx.Pipe(duplex=True)
        proc = self.ctx.Process(
            target=_worker_main, args=(child, self.mix), daemon=True, name="reward-worker"
        )
        proc.start()
        child.close()
        return _Worker(proc, parent)

    def submit(self, job: Job) -> None:
        with self.lock:
            if self.broken is not None:
                broken = self.broken
            else:
                broken = None
                self.pending.append(job)
        if broken is not None:
            self.on_done(job, ScoreResult.failure(broken, self.mix.failure_score))
            return
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self.wake_w, b"x")

    def _fail(self, job: Job, error: str) -> None:
        self.on_done(
            job,
            ScoreResult.failure(error, self.mix.failure_score, time.monotonic() - job.t_submit),
        )

    def _replace(self, i: int) -> None:
        w = self.workers[i]
        with contextlib.suppress(Exception):
            w.process.kill()
        with contextlib.suppress(Exception):
            w.process.join(timeout=5)
        with contextlib.suppress(Exception):  # a sandbox run it was in the middle of
            remove_orphaned_dirs(w.process.pid)
        with contextlib.suppress(Exception):
            w.conn.close()
        self.restarts += 1
        if not self.closed:
            self.workers[i] = self._spawn()

    def _assign(self) -> None:
        for w in self.workers:
            if not (w.ready and w.job is None):
                continue
            with self.lock:
                if not self.pending:
                    return
                job = self.pending.popleft()
            try:
                w.conn.send((job.id, job.prompt, job.completion, job.fields))
            except Exception as e:  # unpicklable fields, or a worker that just died
                self._fail(job, f"cannot send the sample to a reward worker: {e}")
                continue
            w.job = job
            w.started = time.monotonic()

    def _loop(self) -> None:
        try:
            self._run()
        except BaseException as e:  # never leave futures hanging
            self._break(f"reward dispatcher failed: {type(e).__name__}: {e}")

    def _run(self) -> None:
        while not self.closed:
            self._assign()
            now = time.monotonic()
            timeout = 1.0
            if self.timeout_s is not None:
                for w in self.workers:
                    if w.job is not None:
                        timeout = min(timeout, max(0.0, w.started + self.timeout_s - now))
            handles: list[Any] = [self.wake_r]
            for w in self.workers:
                handles.append(w.conn)
                handles.append(w.process.sentinel)
            try:
                ready = set(wait(handles, timeout))
            except OSError:
                ready = set()
            if self.wake_r in ready:
                with contextlib.suppress(BlockingIOError, OSError):
                    while os.read(self.wake_r, 4096):
                        pass
            for i, w in enumerate(list(self.workers)):
                if w.conn in ready:
                    self._receive(i, w)
                elif w.process.sentinel in ready:
                    self._died(i, w)
            if self.timeout_s is not None:
                now = time.monotonic()
                for i, w in enumerate(list(self.workers)):
                    if w.job is not None and now - w.started > self.timeout_s:
                        job, w.job = w.job, None
                        self.timeouts += 1
                        self._replace(i)
                        self._fail(job, f"timeout: reward call exceeded {self.timeout_s:g} s")

    def _receive(self, i: int, w: _Worker) -> None:
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):
            self._died(i, w)
            return
        kind = msg[0]
        if kind == "ready":
            w.ready = True
        elif kind == "done":
            job, w.job = w.job, None
            if job is not None and job.id == msg[1]:
                w.busy_s += time.monotonic() - w.started
                w.calls += 1
                self.on_done(job, msg[2])
                self._maybe_recycle(i, w)
        elif kind == "init_error":
            self._break(f"reward worker failed to start: {msg[1]}")

    def _maybe_recycle(self, i: int, w: _Worker) -> None:
        """Replace an idle worker after ``max_calls`` calls or above ``max_rss_mb`` resident
        memory (a leaking reward function must not grow a worker without bound)."""
        rss = _rss_mb(w.process.pid) if self.max_rss_mb is not None else 0.0
        by_calls = self.max_calls is not None and w.calls >= self.max_calls
        by_rss = self.max_rss_mb is not None and rss > self.max_rss_mb
        if not (by_calls or by_rss) or self.closed:
            return
        why = f"{w.calls} calls" if by_calls else f"{rss:.0f} MB resident > {self.max_rss_mb:g} MB"
        log.info("reward worker %d recycled after %s", w.process.pid, why)
        with contextlib.suppress(Exception):
            w.conn.send(None)
        w.process.join(timeout=2)
        if w.process.is_alive():
            w.process.kill()
            w.process.join(timeout=5)
        with contextlib.suppress(Exception):
            w.conn.close()
        self.recycled += 1
        self.workers[i] = self._spawn()

    def _died(self, i: int, w: _Worker) -> None:
        w.process.join(timeout=5)
        code = w.process.exitcode
        job, w.job = w.job, None
        if not w.ready:
            # died before it could say "ready": a start-up problem, not a reward function's
            self.start_failures += 1
            if self.start_failures >= 3:
                self._break(
                    f"reward workers fail to start (exit code {code}); with the spawn or "
                    "forkserver start method the main module must be importable and guard its "
                    "code with `if __name__ == '__main__':`"
                )
                return
        else:
            self.start_failures = 0
        self._replace(i)
        if job is not None:
            self._fail(job, f"reward worker died (exit code {code}) while scoring")

    def _break(self, reason: str) -> None:
        self.closed = True  # stop dispatching: every later submit fails with the reason
        with self.lock:
            self.broken = reason
            jobs = list(self.pending)
            self.pending.clear()
        for job in jobs:
            self._fail(job, reason)
        for w in self.workers:
            if w.job is not None:
                job, w.job = w.job, None
                self._fail(job, reason)

    def busy_seconds(self) -> float:
        return sum(w.busy_s for w in self.workers)

    def close(self) -> list[Job]:
        self.closed = True
        self._wake()
        self.thread.join(timeout=10)
        for w in self.workers:
            with contextlib.suppress(Exception):
                w.conn.send(None)
        deadline = time.monotonic() + 2.0
        for w in self.workers:
            w.process.join(timeout=max(0.0, deadline - time.monotonic()))
            if w.process.is_alive():
                w.process.kill()
                w.process.join(timeout=5)
            with contextlib.suppress(Exception):
                w.conn.close()
        with contextlib.suppress(OSError):
            os.close(self.wake_r)
            os.close(self.wake_w)
        left = [w.job for w in self.workers if w.job is not None]
        with self.lock:
            left.extend(self.pending)
            self.pending.clear()
        return left


def _rss_mb(pid: int) -> float:
    """Resident memory of a process in MB (0 when unknown)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return 0.0
    return pages * os.sysconf("SC_PAGE_SIZE") / 1e6
