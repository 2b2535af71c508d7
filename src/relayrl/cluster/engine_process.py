"""The rollout engine in its own worker process (the ``local`` backend, several processes).

The trainer process talks to it through an :class:`EngineProcess` client with the rollout
interface (``submit``, ``poll``, ``generate``, ``update_weights``, ``stats``). Weights move
trainer -> engine through shared memory, never through disk: the client owns one shared
tensor per state-dict entry; an update copies the new weights in and sends only the version;
the worker copies them into its model and acknowledges, and the next update waits for that
acknowledgement before it overwrites the shared tensors.

The shared tensors live on the engine's device (``EngineSpec.device``): on the CPU in shared
memory; on CUDA ``torch.multiprocessing`` hands them to the worker as CUDA IPC handles (the
same GPU memory in both processes, no copy through host memory). The code is the same; a
CUDA copy is asynchronous, so each side synchronises its device before it tells the other
that the shared tensors are written (update) or read (ack).

A background thread in the client drains the worker's results into queues, so generation
never stalls on a full pipe while the trainer is busy. If the worker dies, every client call
raises :class:`RolloutWorkerDied` naming its pid and exit code.

The worker lives and dies with its client: it ignores SIGINT from its first instruction (Ctrl-C
reaches the whole process group; the trainer stops it through ``close``), outlives a SIGTERM by
``TERM_GRACE_S`` (the trainer, signalled with it, still needs it to finish its step), and exits
quietly, without a traceback, as soon as its parent is gone (its pipes close or its parent pid
changes).
The shared tensors are file-descriptor backed (torch's default on Linux): nothing stays in
``/dev/shm`` once both processes have ended.
"""

from __future__ import annotations

import atexit
import itertools
import os
import queue
import signal
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import Tensor

from relayrl.cluster.live_requests import (
    ClientStreams,
    Progress,
    WorkerStreams,
    drain_queue,
    tag,
    untag,
)
from relayrl.rollout import EngineReport, GenerationRequest, Sample, error_sample
from relayrl.rollout.backend import SteppingEngine

_CTX = mp.get_context("spawn")
EVAL_TAG = "_eval_ticket"


class RolloutWorkerDied(RuntimeError):
    """The engine worker process exited unexpectedly."""


class WeightSyncFailed(RolloutWorkerDied):
    """A weight update did not reach the engine worker within ``weight_sync.timeout_s``: the
    worker is alive but never loaded the previous version (hung, stopped). The shared weights
    are left as they were, so the engine never serves a half-updated model (docs/failures.md).
    """


@dataclass
class EngineSpec:
    """What the worker needs to build its engine (the weights come through shared memory)."""

    model_path: str
    dtype: str
    eos_token_id: int
    pad_token_id: int
    max_slots: int
    threads: int
    version: int
    urgent_steps: int  # async.urgent_steps
    max_model_len: int | None = None  # rollout.max_model_len (None: the model's own)
    backend: str = "own"  # rollout.backend, and its vLLM knobs
    vllm_interrupt: str = "reprefill"
    vllm_kv_cache_gib: float = 0.25
    vllm_process: str = "auto"
    vllm_gpu_memory_utilization: float | None = None
    device: str = "cpu"
    """Where the own engine computes and the shared weights live (``cpu``, ``cuda:<i>``); the
    vLLM backend places itself (its shared weights stay on the CPU)."""
    cuda_graphs: bool | None = None  # rollout.cuda_graphs (None: on for CUDA)
    weight_sync_timeout_s: float = 600.0  # weight_sync.timeout_s (a vLLM server's updates)

    def shared_device(self) -> torch.device:
        """The device of the shared weight tensors (CPU for the vLLM backend)."""
        return torch.device(self.device if self.backend == "own" else "cpu")


def shared_weights(state_dict: Mapping[str, Tensor], device: torch.device) -> dict[str, Tensor]:
    """One contiguous copy per entry on ``device``, ready to pass to a spawned process: CPU:
    moved to shared memory; CUDA: as is (``share_memory_`` is a no-op there; the process
    receives a CUDA IPC handle). Synchronised: the copies are complete when this returns."""
    out = {
        k: v.detach().to(device, copy=True).contiguous().share_memory_()
        for k, v in state_dict.items()
    }
    synchronize(device)
    return out


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_device(device: torch.device) -> None:
    """A clear error before spawning a worker for a device this machine lacks."""
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"EngineSpec.device={str(device)!r}: the engine runs on cpu or cuda")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or (device.index is not None and device.index >= count):
            raise ValueError(
                f"EngineSpec.device={str(device)!r} but this machine has {count} CUDA "
                f"device(s) (torch {torch.__version__})"
            )


def build_own_engine(spec: EngineSpec, shared: Mapping[str, Tensor]) -> Any:
    """The worker's own engine: the model of ``spec`` on ``spec.device``, the shared weights
    loaded into it."""
    from relayrl.model import load_causal_lm
    from relayrl.rollout import RolloutEngine

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
    device = torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = load_causal_lm(spec.model_path, dtype[spec.dtype])
    # transformers wraps PreTrainedModel.to in functools.wraps(nn.Module.to): the stubs'
    # _Wrapped takes its first argument for ``self``
    model = model.to(device)  # type: ignore[arg-type]
    model = model.eval().requires_grad_(False)
    with torch.no_grad():
        model.load_state_dict(shared)
    synchronize(device)  # the shared tensors are read before the client may overwrite them
    return RolloutEngine(
        model,
        eos_token_id=spec.eos_token_id,
        pad_token_id=spec.pad_token_id,
        max_slots=spec.max_slots,
        max_model_len=spec.max_model_len,
        version=spec.version,
        urgent_steps=spec.urgent_steps,
        device=device,
        cuda_graphs=spec.cuda_graphs,
    )


TERM_GRACE_S = 15.0
"""After a SIGTERM the worker goes on serving this long, then exits. A SIGTERM sent to the
whole process group (slurm, systemd, ``timeout``) reaches the trainer too, which finishes its
step, checkpoints it and stops the worker; the worker must not die under it meanwhile."""


def _worker_main(spec: EngineSpec, shared: dict[str, Tensor], cmd_conn: Any, out_conn: Any) -> None:
    """The worker: ignore Ctrl-C, serve the client, return quietly once the client is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent was ignoring it at the spawn too
    parent = os.getppid()
    term_deadline: list[float] = []

    def on_sigterm(signum: int, frame: Any) -> None:
        if not term_deadline:
            term_deadline.append(time.monotonic() + TERM_GRACE_S)

    signal.signal(signal.SIGTERM, on_sigterm)

    def must_exit() -> bool:
        """The parent is gone (we were re-parented), or the SIGTERM grace is over."""
        return os.getppid() != parent or bool(term_deadline and time.monotonic() > term_deadline[0])

    try:
        _serve(spec, shared, cmd_conn, out_conn, must_exit)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the parent closed its ends of the pipes (or died): nothing left to serve


def _serve(
    spec: EngineSpec,
    shared: dict[str, Tensor],
    cmd_conn: Any,
    out_conn: Any,
    must_exit: Callable[[], bool],
) -> None:
    """The worker's loop: take commands, step the engine while it has work, ship samples."""
    os.environ["OMP_NUM_THREADS"] = str(spec.threads)
    torch.set_num_threads(spec.threads)
    device = spec.shared_device()
    owns_server = False  # a vLLM server process (rollout.vllm_process: server)
    try:
        if spec.backend == "vllm":  # rollout.backend: vllm (same interface, same loop)
            from relayrl.rollout.vllm_select import engine_from_spec
            from relayrl.rollout.vllm_server import VllmServerEngine

            engine: SteppingEngine = engine_from_spec(spec, shared)  # in process or a server
            owns_server = isinstance(engine, VllmServerEngine)
        else:
            engine = build_own_engine(spec, shared)
    except Exception:
        out_conn.send(("fatal", traceback.format_exc()))
        return
    out_conn.send(("ready", os.getpid()))
    try:
        _engine_loop(engine, spec, shared, cmd_conn, out_conn, must_exit, device)
    finally:  # the server stops with the worker
        if owns_server:
            engine.close()


def _engine_loop(
    engine: SteppingEngine,
    spec: EngineSpec,
    shared: dict[str, Tensor],
    cmd_conn: Any,
    out_conn: Any,
    must_exit: Callable[[], bool],
    device: torch.device,
) -> None:
    busy_since: float | None = None
    spans: list[tuple[float, float]] = []
    live = WorkerStreams(engine)  # submit_live requests: streamed tokens, abort by key
    while True:
        if must_exit():
            return
        has_work = engine.has_unfinished()
        if not cmd_conn.poll(0 if has_work else 0.5):
            if not has_work:
                continue
        else:
            while cmd_conn.poll(0):
                msg = cmd_conn.recv()
                kind = msg[0]
                if kind == "submit":
                    errors, accepted = [], []
                    for req in msg[1]:
                        try:
                            rid = engine.submit(req)
                        except ValueError as exc:  # this request only: the client is told
                            errors.append((req, str(exc)))
                            continue
                        update = live.submitted(req, rid)
                        if update is not None:
                            accepted.append(update)
                    if errors:
                        out_conn.send(("rejected", errors))
                    if accepted:
                        out_conn.send(("progress", accepted))
                elif kind == "abort":
                    live.abort(msg[1])
                elif kind == "update":
                    _, version, interrupt = msg
                    engine.update_weights(shared, version, interrupt=interrupt)
                    synchronize(device)  # read before the ack lets the client overwrite
                    out_conn.send(("updated", version))
                elif kind == "prioritize":
                    engine.prioritize(msg[1])
                elif kind == "stats":
                    if busy_since is not None:  # report the open busy span up to now
                        now = time.perf_counter()
                        spans.append((busy_since, now))
                        busy_since = now
                    out_conn.send(("stats", engine.stats(), spans))
                    spans = []
                elif kind == "stop":
                    out_conn.send(("stopped", None))
                    return
        if engine.has_unfinished():
            t0 = time.perf_counter()
            busy_since = t0 if busy_since is None else busy_since
            finished = engine.step()
            if finished:
                live.finished(finished)
                out_conn.send(("samples", finished))
            updates = live.updates()
            if updates:
                out_conn.send(("progress", updates))
        elif busy_since is not None:
            spans.append((busy_since, time.perf_counter()))
            busy_since = None


def _close_at_exit(ref: weakref.ref[EngineProcess]) -> None:
    client = ref()
    if client is not None:
        client.close()


def _start_ignoring_sigint(process: Any) -> None:
    """Start ``process`` with SIGINT ignored, so a Ctrl-C while the child is still importing
    torch (before its first instruction) does not print its traceback. An ignored signal stays
    ignored across exec, and Python then installs no KeyboardInterrupt handler of its own."""
    if threading.current_thread() is not threading.main_thread():
        process.start()
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        process.start()
    finally:
        signal.signal(signal.SIGINT, previous)


class EngineProcess:
    """Client of an engine worker process: a :class:`~relayrl.rollout.PollingBackend`."""

    supports_top_logprobs = True  # the worker's engines (own, vLLM) keep them: sample, progress

    def __init__(
        self,
        spec: EngineSpec,
        state_dict: Mapping[str, Tensor],
        start_timeout: float = 120,
        sync_timeout_s: float = 600.0,
    ):
        self.spec = spec
        self.sync_timeout_s = sync_timeout_s  # weight_sync.timeout_s
        self.version = spec.version
        self.device = spec.shared_device()
        check_device(self.device)
        self._shared = shared_weights(state_dict, self.device)
        self._cmd_recv, self._cmd_send = _CTX.Pipe(duplex=False)
        self._out_recv, self._out_send = _CTX.Pipe(duplex=False)
        self.process = _CTX.Process(
            target=_worker_main,
            args=(spec, self._shared, self._cmd_recv, self._out_send),
            daemon=True,
            name="relayrl-rollout",
        )
        _start_ignoring_sigint(self.process)
        self._out_send.close()
        self._cmd_recv.close()
        self._samples: queue.Queue[Sample] = queue.Queue()
        self._eval: dict[int, Sample] = {}
        self._eval_cv = threading.Condition()
        self._acked = threading.Event()
        self._acked.set()
        self._stats_q: queue.Queue[EngineReport] = queue.Queue()
        self._rejected: queue.Queue[tuple[GenerationRequest, str]] = queue.Queue()
        self._live = ClientStreams()  # submit_live requests' streamed tokens
        self._send_lock = threading.Lock()
        self._tickets = itertools.count()
        self._dead: str | None = None
        self._stopping = False
        try:
            first = self._recv_first(start_timeout)
        except BaseException:  # Ctrl-C during start-up, or a failed start: leave no worker
            self._stopping = True
            if self.process.is_alive():
                self.process.kill()
            self.process.join(timeout=5)
            raise
        self.pid = first
        self._receiver = threading.Thread(target=self._receive_loop, daemon=True)
        self._receiver.start()
        # before multiprocessing's own exit hook (atexit runs last-registered first), which
        # would wait for a worker that is still in its SIGTERM grace
        atexit.register(_close_at_exit, weakref.ref(self))

    # ----------------------------------------------------------------- plumbing
    def _recv_first(self, timeout: float) -> int:
        if not self._out_recv.poll(timeout):
            self.process.kill()
            raise RolloutWorkerDied(f"rollout worker did not start within {timeout:.0f} s")
        try:
            kind, payload = self._out_recv.recv()
        except EOFError:
            self.process.join(timeout=5)
            raise RolloutWorkerDied(
                f"rollout worker exited during start-up (exit code {self.process.exitcode}); "
                "scripts that start relayrl runs need an `if __name__ == '__main__':` guard"
            ) from None
        if kind == "fatal":
            raise RolloutWorkerDied(f"rollout worker failed to start:\n{payload}")
        return int(payload)

    def _receive_loop(self) -> None:
        while True:
            try:
                msg = self._out_recv.recv()
            except (EOFError, OSError):
                if not self._stopping:
                    self.process.join(timeout=1)
                    self._dead = (
                        f"rollout worker (pid {self.process.pid}) died with exit code "
                        f"{self.process.exitcode}"
                    )
                self._acked.set()
                with self._eval_cv:
                    self._eval_cv.notify_all()
                return
            kind = msg[0]
            if kind == "progress":
                self._live.add(msg[1])
            elif kind == "samples":
                for s in msg[1]:
                    self._arrived(s)
            elif kind == "updated":
                self._acked.set()
            elif kind == "stats":
                self._stats_q.put(EngineReport(msg[1], msg[2]))
            elif kind == "rejected":
                for req, error in msg[1]:
                    self._arrived(error_sample(-1, req, error), (req, error))
            elif kind == "stopped":
                return

    def _arrived(self, s: Sample, refused: tuple[GenerationRequest, str] | None = None) -> None:
        """A request's end (``refused``: the worker's engine refused it, ``s`` its ``'abort'``
        sample, as the engine's own ``generate`` hands back): a ``generate`` request's sample
        goes to its caller, any other to ``poll``, or when refused to ``rejected()``."""
        key = untag(s.metadata)
        if key is not None:
            self._live.forget(key)
        ticket = s.metadata.get(EVAL_TAG)
        if ticket is not None:
            with self._eval_cv:
                self._eval[ticket] = s
                self._eval_cv.notify_all()
        elif refused is None:
            self._samples.put(s)
        else:
            self._rejected.put(refused)

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise RolloutWorkerDied(self._dead)
        if not self.process.is_alive() and not self._stopping:
            self.process.join(timeout=1)
            self._dead = (
                f"rollout worker (pid {self.process.pid}) died with exit code "
                f"{self.process.exitcode}"
            )
            raise RolloutWorkerDied(self._dead)

    def _send(self, msg: tuple[Any, ...]) -> None:
        self._check_alive()
        with self._send_lock:
            try:
                self._cmd_send.send(msg)
            except (BrokenPipeError, OSError) as exc:
                if self._stopping:
                    raise
                # The worker's end of the pipe is gone: it is exiting. Wait for the exit so the
                # error names its exit code instead of racing the process table.
                self.process.join(timeout=5)
                self._check_alive()
                raise RolloutWorkerDied(
                    f"rollout worker (pid {self.process.pid}) closed its command pipe ({exc})"
                ) from exc

    # ----------------------------------------------------------------- interface
    @property
    def max_slots(self) -> int:
        """The worker engine's slots (``spec.max_slots``)."""
        return self.spec.max_slots

    @property
    def max_model_len(self) -> int | None:
        """``spec.max_model_len`` (rollout.max_model_len); None when the worker's engine reads
        it from the model."""
        return self.spec.max_model_len

    def submit_many(self, requests: Iterable[GenerationRequest]) -> None:
        self._send(("submit", list(requests)))

    def submit(self, request: GenerationRequest) -> None:
        self.submit_many([request])

    def submit_live(self, request: GenerationRequest, key: int, stream: bool = True) -> None:
        """Submit ``request`` under the caller's ``key`` (unique among live requests): it can
        be aborted with ``abort(key)``, and when ``stream`` its tokens are read with
        ``progress(key, start)`` while it runs (:mod:`relayrl.cluster.live_requests`). Its
        sample comes out of ``poll`` as any other."""
        self._live.submitted(key)
        self._send(("submit", [tag(request, key, stream)]))

    def progress(self, key: int, start: int = 0) -> Progress | None:
        """A streamed live request's tokens from ``start`` on, as (ids, behaviour logprobs,
        versions[, top_logprobs alternatives when asked]) sent so far (once per engine step);
        None before the worker accepted it and once its sample arrived (it holds every token)."""
        return self._live.progress(key, start)

    def abort(self, key: int) -> bool:
        """Stop the live request ``key`` in the worker (``engine.abort``): its ``'abort'``
        sample (the tokens so far) comes out of ``poll``, and its slot is free at the worker's
        next step. False when the request's sample already arrived (nothing is sent)."""
        if key not in self._live.keys:
            return False
        self._send(("abort", [key]))
        return True

    def prioritize(self, group_ids: Iterable[int]) -> None:
        """``RolloutEngine.prioritize`` in the worker: these groups' rows are urgent."""
        self._send(("prioritize", list(group_ids)))

    def poll(self, timeout: float = 0.0) -> list[Sample]:
        """Finished samples so far (waits up to ``timeout`` seconds for the first one)."""
        self._check_alive()
        out = drain_queue(self._samples, timeout)
        if not out:
            self._check_alive()
        return out

    def generate(self, requests: list[GenerationRequest]) -> list[Sample]:
        """Blocking: complete ``requests`` (alongside anything else in flight), in order."""
        tickets = [next(self._tickets) for _ in requests]
        tagged = [
            GenerationRequest(r.prompt_ids, r.params, r.group_id, {**r.metadata, EVAL_TAG: t})
            for r, t in zip(requests, tickets, strict=True)
        ]
        self._send(("submit", tagged))
        with self._eval_cv:
            while not all(t in self._eval for t in tickets):
                self._check_alive()
                self._eval_cv.wait(timeout=0.5)
            out = [self._eval.pop(t) for t in tickets]
        for s in out:
            s.metadata.pop(EVAL_TAG, None)
        return out

    def update_weights(
        self, state_dict: Mapping[str, Tensor], version: int, interrupt: bool = True
    ) -> None:
        """Copy weights into the shared tensors and tell the worker to load them as
        ``version``. The previous update must have been loaded first: a worker that has not
        within ``sync_timeout_s`` is a :class:`WeightSyncFailed` (nothing is copied)."""
        deadline = time.monotonic() + self.sync_timeout_s
        while not self._acked.wait(timeout=0.5):  # the previous update must have been read
            self._check_alive()
            if time.monotonic() > deadline:
                raise WeightSyncFailed(
                    f"weight sync of version {version} to the rollout worker (pid "
                    f"{self.process.pid}) failed: it has not loaded version {self.version} "
                    f"within {self.sync_timeout_s:g} s (weight_sync.timeout_s); the shared "
                    "weights were left as they were"
                )
        self._check_alive()
        with torch.no_grad():
            for k, v in state_dict.items():
                self._shared[k].copy_(v)
        synchronize(self.device)  # written before the worker reads
        self._acked.clear()
        self._send(("update", version, interrupt))
        self.version = version

    def wait_weights_loaded(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not self._acked.wait(timeout=0.2):
            self._check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError("rollout worker did not load the weights in time")

    def report(self, timeout: float = 30) -> EngineReport:
        """Engine counters and its busy spans (perf_counter seconds) since the last report."""
        self._send(("stats",))
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self._stats_q.get(timeout=0.2)
            except queue.Empty:
                self._check_alive()
                if time.monotonic() > deadline:
                    raise TimeoutError("rollout worker did not answer stats") from None

    def rejected(self) -> list[tuple[GenerationRequest, str]]:
        """(request, error) of those the worker's engine refused since the last call."""
        return drain_queue(self._rejected, 0)

    def close(self) -> None:
        self._stopping = True
        if self.process.is_alive():
            try:
                with self._send_lock:
                    self._cmd_send.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
            self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
