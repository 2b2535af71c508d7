"""Train an agent written elsewhere: the user's function runs against the endpoint.

The user gives ``agent(base_url, api_key, row) -> float`` (sync or async; ``env.agent.function:
"module:function"``). It runs its agent with the official ``openai`` client
(``openai.OpenAI(base_url=base_url, api_key=api_key)``), over as many chat / completion calls
as it likes, and returns the rollout's reward: a number, or per-call rewards ``{reply id:
reward}`` keyed by the ``id`` of the chat completions / completions / responses it got (as
AReaL's workflows key them; :func:`per_call_rewards`): the rollout's outcome is then its last
call's reward, the earlier calls' rewards are turn rewards, and each call is a turn for
``algo.turn_credit``. :class:`AgentRollout` looks like an engine to
the controller (``generate(requests) -> samples``, ``update_weights``, ``report``, ...): for
every request (one rollout of a GRPO group) it

1. opens a session on the :class:`~relayrl.env.openai_server.OpenAIServer` whose sampling is
   the request's (temperature / top_p / top_k of ``rollout.*``, whatever the agent asks, so
   the trainer's recomputed logprobs are of the distribution sampled from; ``max_tokens`` a
   cap per call; call k's seed derived from the request's seed). The server caps a call's
   ``max_tokens`` at the rest of the context (``cap_max_tokens``) where ``relayrl serve``
   answers vLLM's 400: a conversation that grew to the context's end ends its turn in
   ``length``, a recorded sample, not an agent error;
2. runs the agent (up to ``env.agent.concurrency`` at once) with ``env.agent.timeout_s``. A
   sync agent runs in a daemon thread of its own: one that hangs past its timeout is recorded
   ``timeout`` and its slot goes to the next rollout at once (its thread is abandoned, counted
   in ``agent/abandoned``, and never holds up the process's exit; its later calls to the
   endpoint get 404), so hung agents never starve the others nor a later evaluation;
3. turns the session's recorded calls into one sample in the episode runner's format
   (:mod:`relayrl.env.runner`): the trajectory of the agent's last call, loss mask 1 on the
   model's tokens only, the engine's behaviour logprobs and versions, and
   ``metadata["env"]`` with ``stop_reason`` (``env_done``), ``outcome`` (the agent's reward,
   which :func:`agent_reward` and ``env.outcome: env`` read), ``turns`` (calls),
   ``prefix_breaks``, ``final_turn`` (the last call's span) and ``segments``: the session's
   other trajectories (a branching agent, or a re-rendering that broke the prefix property),
   trained as samples of their own by ``relayrl.env.scoring.expand_segments``; plus
   ``metadata["env"]["agent"]``, the session's counts.

A failed rollout (the agent raised, timed out, made no call, or returned something that is not
a finite number) is a recorded failure, never a crashed step: stop reason ``env_error`` /
``timeout``, reward 0, every loss mask all 0 (nothing of it is trained), the error in
``metadata["env"]["error"]``; ``stats()['agent/failures']`` counts it.

Schedules: all three. ``generate`` (the sync schedule, the held-out evaluation) runs a
batch of rollouts to their end; ``submit_many`` / ``poll`` (the async controller) start
rollouts and hand back each as it finishes, one sample per request, so GRPO groups fill as
single-turn ones do. Rollouts run in one asyncio loop in its own thread; weight updates go
through the engine's owner thread between engine steps, and every token keeps the version the
engine stamped on it (a rollout whose calls straddle an update has tokens of both versions;
staleness is counted per token).
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import math
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

from relayrl.env.agent_engine import EngineOwner
from relayrl.env.agent_process import ProcessAgent
from relayrl.env.openai_server import OpenAIServer
from relayrl.env.pool import DaemonThreadExecutor
from relayrl.env.registry import load_callable
from relayrl.env.scoring import EpisodeScorer
from relayrl.env.sessions import Session
from relayrl.rollout.backend import PollingBackend, SteppingEngine
from relayrl.rollout.types import EngineReport, GenerationRequest, Sample

AgentFn = Callable[[str, str, dict[str, Any]], Any]
"""``agent(base_url, api_key, row) -> reward | {reply id: reward}`` (sync or async)."""
INTERNAL_KEYS = ("sample_index",)


def load_agent(spec: str) -> AgentFn:
    """``"package.module:function"`` -> the function (a clear error naming what is missing)."""
    return load_callable(spec, "env.agent.function", "function")


def agent_reward(prompt: str, completion: str, sample: dict) -> float:
    """The reward function of agent rollouts: the reward the agent returned (0 for a failed
    rollout), ``metadata["env"]["outcome"]``."""
    info = sample.get("env") or {}
    return float(info.get("outcome") or 0.0)


class AgentRollout:
    """The rollout role of an agent run (see module): ``generate`` runs one agent per request.
    A :class:`~relayrl.rollout.PollingBackend` over the engine's.

    Args:
        engine: the engine (or an :class:`EngineOwner` of it); every engine call, weight
            updates included, goes through the owner's one thread.
        tokenizer: the model's tokenizer.
        agent: the user's function, or its ``"module:function"`` spec.
        timeout_s: wall-clock limit of one rollout.
        concurrency: rollouts running at once.
        isolation: ``thread`` or ``process`` (``env.agent.isolation``).
        max_sequences_per_request: the endpoint's bound on prompts x ``n`` of one request
            (``env.agent.max_sequences_per_request``; None: unbounded).
    """

    def __init__(
        self,
        engine: SteppingEngine | PollingBackend | EngineOwner,
        tokenizer: Any,
        agent: AgentFn | str,
        timeout_s: float = 120.0,
        concurrency: int = 16,
        isolation: str = "thread",
        max_sequences_per_request: int | None = 256,
    ) -> None:
        self.agent = load_agent(agent) if isinstance(agent, str) else agent
        if isolation == "process":  # each rollout's agent in a worker process, killed on timeout
            self.agent = ProcessAgent(self.agent)
        elif isolation != "thread":
            raise ValueError(f"env.agent.isolation: {isolation!r} is not thread or process")
        self._awaitable = inspect.iscoroutinefunction(self.agent) or isolation == "process"
        self.engine = engine.engine if isinstance(engine, EngineOwner) else engine
        self.owner = engine if isinstance(engine, EngineOwner) else EngineOwner(engine)
        self.tokenizer = tokenizer
        self.timeout_s = timeout_s
        self.concurrency = concurrency
        self.server = OpenAIServer(
            self.owner,
            tokenizer,
            cap_max_tokens=True,
            max_sequences_per_request=max_sequences_per_request,
        )
        self.server.start()
        self._pool = DaemonThreadExecutor()  # a thread per sync agent call (see module)
        self._counts: dict[str, float] = {}
        self._reported: dict[str, float] = {}
        self._ids = itertools.count()
        self._done: queue.Queue[Sample] = queue.Queue()
        self._unfinished = 0
        self._error: BaseException | None = None
        self._closed = False
        self._lock = threading.Lock()
        self.version = self.engine.version
        self._loop = asyncio.new_event_loop()
        self._limit: asyncio.Semaphore | None = None
        self._loop_thread = threading.Thread(
            target=self._loop.run_forever, name="agent-loop", daemon=True
        )
        self._loop_thread.start()

    # ------------------------------------------------------------------ engine interface
    def generate(self, requests: Sequence[GenerationRequest]) -> list[Sample]:
        """Run one agent rollout per request to its end; their samples, in request order."""
        futures = [self._start(r) for r in requests]
        return [f.result() for f in futures]

    def submit_many(self, requests: Iterable[GenerationRequest]) -> None:
        """Start one rollout per request; finished ones come out of ``poll`` (async
        schedules)."""
        for r in requests:
            fut = self._start(r)
            with self._lock:
                self._unfinished += 1
            fut.add_done_callback(self._on_done)

    def submit(self, request: GenerationRequest) -> None:
        self.submit_many([request])

    def poll(self, timeout: float = 0.0) -> list[Sample]:
        """Rollouts finished so far (waits up to ``timeout`` s for the first)."""
        out: list[Sample] = []
        try:
            out.append(self._done.get(timeout=timeout) if timeout > 0 else self._done.get_nowait())
            while True:
                out.append(self._done.get_nowait())
        except queue.Empty:
            pass
        for err in (self.owner.error, self._error):
            if err is not None:
                raise RuntimeError(f"agent rollouts failed: {err}") from err
        return out

    def has_unfinished(self) -> bool:
        return self._unfinished > 0 or not self._done.empty()

    def update_weights(self, state_dict: Any, version: int, interrupt: bool = True) -> None:
        """The engine's update, run on its owner thread between engine steps: calls in flight
        carry the versions the engine stamps (``interrupt``: re-prefilled under the new
        weights, as without agents)."""
        self.owner.call(lambda e: e.update_weights(state_dict, version, interrupt=interrupt))
        self.version = version

    def prioritize(self, group_ids: Iterable[int]) -> None:
        ids = list(group_ids)
        self.owner.call(lambda e: e.prioritize(ids))

    @property
    def max_slots(self) -> int | None:
        return self.engine.max_slots

    @property
    def max_model_len(self) -> int | None:
        return self.engine.max_model_len

    def rejected(self) -> list[tuple[GenerationRequest, str]]:
        """Nothing: a call the engine refuses is answered with an error to the agent."""
        return []

    def report(self) -> EngineReport:
        return self.owner.call(lambda e: e.report())

    def stats(self) -> dict[str, Any]:
        """The engine's counters, plus ``agent/*``: rollouts, failures, calls, prefix breaks,
        trajectories, model and observation tokens (since the start)."""
        out = dict(self.report().counters)
        with self._lock:
            out.update({f"agent/{k}": v for k, v in self._counts.items()})
        return out

    def env_metrics(self) -> dict[str, float]:
        """``env/agent_*`` counts since the last call (the schedules log them per step):
        rollouts, failures, calls, trajectories, prefix_breaks, errors (calls answered with
        an error), model_tokens, observation_tokens."""
        with self._lock:
            now = dict(self._counts)
            delta = {k: v - self._reported.get(k, 0.0) for k, v in now.items()}
            self._reported = now
        return {f"env/agent_{k}": v for k, v in delta.items()}

    def close(self) -> None:
        """Stop the endpoint, the owner thread, the rollout loop and the engine (once)."""
        if self._closed:
            return
        self._closed = True
        self.server.stop()
        self.owner.close()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop_thread.join(timeout=10)
        if not self._loop_thread.is_alive():
            self._loop.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.engine.close()

    # ------------------------------------------------------------------ rollouts
    def _start(self, request: GenerationRequest) -> Future[Sample]:
        rid = next(self._ids)
        return asyncio.run_coroutine_threadsafe(self._limited(rid, request), self._loop)

    def _on_done(self, fut: Future[Sample]) -> None:
        with self._lock:
            self._unfinished -= 1
        if fut.exception() is None:
            self._done.put(fut.result())
        else:  # a bug of relayrl's, not the agent's (those are recorded): poll raises it
            self._error = fut.exception()

    async def _limited(self, rid: int, request: GenerationRequest) -> Sample:
        if self._limit is None:
            self._limit = asyncio.Semaphore(self.concurrency)
        async with self._limit:
            return await self._rollout(rid, request)

    def _sampling(self, req: GenerationRequest) -> dict[str, Any]:
        p = req.params
        greedy = p.greedy or p.temperature == 0
        return {
            "temperature": 0.0 if greedy else p.temperature,
            "top_p": 1.0 if greedy else p.top_p,
            "top_k": 0 if greedy else p.top_k,
            "max_tokens": p.max_tokens,
            "seed": p.seed,
        }

    async def _call_agent(self, session: Session, row: dict[str, Any]) -> Any:
        url = self.server.base_url(session)
        if self._awaitable:
            return await self.agent(url, session.key, row)
        loop = asyncio.get_running_loop()
        out = await loop.run_in_executor(self._pool, self.agent, url, session.key, row)
        if inspect.isawaitable(out):
            out = await out
        return out

    async def _rollout(self, index: int, req: GenerationRequest) -> Sample:
        row = {k: v for k, v in req.metadata.items() if k not in INTERNAL_KEYS}
        session = self.server.open_session(sampling=self._sampling(req))
        t0 = time.perf_counter()
        error: str | None = None
        reason = "env_done"
        reward = 0.0
        call_rewards: dict[int, float] | None = None
        try:
            out = await asyncio.wait_for(self._call_agent(session, row), self.timeout_s)
            if isinstance(out, Mapping):  # per-call rewards, keyed by the replies' ids
                call_rewards, error = per_call_rewards(out, session)
            elif (
                isinstance(out, bool) or not isinstance(out, (int, float)) or not math.isfinite(out)
            ):
                error = f"the agent returned {out!r}, expected a finite number (the reward)"
            else:
                reward = float(out)
        except TimeoutError:
            reason, error = "timeout", f"the agent ran past env.agent.timeout_s={self.timeout_s:g}"
            if not self._awaitable:
                with self._lock:  # its thread runs on (a thread cannot be stopped)
                    self._counts["abandoned"] = self._counts.get("abandoned", 0.0) + 1
        except Exception as e:  # the agent's own failure: recorded, the step goes on
            error = f"the agent raised {type(e).__name__}: {e}"
        finally:
            self.server.close_session(session.key)  # later calls of a timed-out agent: 404
        if error is None and not session.calls:
            error = "the agent made no call to the endpoint"
        if error is not None and reason == "env_done":
            reason = "env_error"
        stats = session.stats()
        self._count(stats, error is not None)
        smp = self._episode_sample(index, req, session, reason, reward, error, t0, stats)
        if call_rewards is not None and error is None:
            credit_calls(smp, session, call_rewards)
        return smp

    def _episode_sample(
        self,
        index: int,
        req: GenerationRequest,
        session: Session,
        reason: str,
        reward: float,
        error: str | None,
        t0: float,
        stats: Mapping[str, float],
    ) -> Sample:
        """The rollout as one sample in the episode runner's format: the trajectory of the
        agent's last call, the other trajectories in ``metadata["env"]["segments"]``."""
        failed = error is not None
        info: dict[str, Any] = {
            "stop_reason": reason,
            "turns": len(session.calls),
            "outcome": 0.0 if failed else reward,
            "turn_rewards": [],
            "tool_calls": 0,
            "tool_errors": 0,
            "prefix_breaks": session.prefix_breaks,
            "final_turn": None,
            "error": error,
            "infos": [],
            "time_s": time.perf_counter() - t0,
            "agent": dict(stats),
        }
        meta = {**req.metadata}
        samples = session.to_samples(index, req.group_id, meta)
        if not samples:
            return Sample(
                index, list(req.prompt_ids), [], [], [], "abort", req.group_id,
                {**meta, "env": info}, error=error, loss_mask=[],
            )  # fmt: skip
        last_traj = session.calls[-1].trajectory
        main = next(s for s in samples if s.metadata["agent_trajectory"] == last_traj)
        n_last = len(session.calls[-1].completion_ids)
        info["final_turn"] = (len(main.response_ids) - n_last, len(main.response_ids))
        segments = [s for s in samples if s is not main]
        for seg in segments:
            seg.metadata = {**meta, "env": {"segment_of": index}}
        info["segments"] = segments
        main.metadata = {**meta, "env": info}
        for smp in (main, *segments):
            # tokens of more than one policy version: the rollout straddled a weight update
            # (counted as interrupted, as an engine sample re-prefilled under new weights is)
            mask = smp.loss_mask or [1] * len(smp.versions)
            model_versions = {v for v, k in zip(smp.versions, mask, strict=True) if k}
            smp.num_interrupts = max(smp.num_interrupts, len(model_versions) - 1)
            if failed:
                smp.loss_mask = [0] * len(smp.response_ids)
                smp.finish_reason = "abort"
                smp.error = error
        return main

    def _count(self, stats: Mapping[str, float], failed: bool) -> None:
        with self._lock:
            self._add_counts(stats, failed)

    def _add_counts(self, stats: Mapping[str, float], failed: bool) -> None:
        c = self._counts
        c["rollouts"] = c.get("rollouts", 0.0) + 1
        c["failures"] = c.get("failures", 0.0) + float(failed)
        for k, v in stats.items():
            c[k] = c.get(k, 0.0) + v


_ID_PREFIXES = ("chatcmpl-", "resp_", "cmpl-")


def _id_key(rid: str) -> str:
    for p in _ID_PREFIXES:
        if rid.startswith(p):
            return rid[len(p) :]
    return rid


def per_call_rewards(
    out: Mapping[Any, Any], session: Session
) -> tuple[dict[int, float], str | None]:
    """An agent's per-call rewards ``{reply id: reward}`` (the ``id`` of a chat completion,
    completion or response it got, as AReaL's workflows key them) -> ``{call index: reward}``,
    or an error naming an unknown id or a reward that is not a finite number."""
    index = {_id_key(c.response_id): i for i, c in enumerate(session.calls) if c.response_id}
    rewards: dict[int, float] = {}
    for rid, value in out.items():
        i = index.get(_id_key(str(rid)))
        if i is None:
            return {}, f"the agent returned a reward for {rid!r}, not a call of its rollout"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return {}, f"the agent's reward for {rid!r} is {value!r}, not a number"
        if not math.isfinite(value):
            return {}, f"the agent's reward for {rid!r} is {value!r}, not finite"
        rewards[i] = float(value)
    return rewards, None


def credit_calls(sample: Sample, session: Session, rewards: Mapping[int, float]) -> None:
    """Per-call rewards on the rollout's sample (its last trajectory): the outcome is its last
    call's reward (0 without one), the earlier calls' rewards are its turn rewards, and each
    call's span is a turn (``turn_spans`` / ``turn_step_rewards``: ``algo.turn_credit``)."""
    info = sample.metadata.get("env")
    if not info or not session.calls:
        return
    last = session.calls[-1].trajectory
    idx = [i for i, c in enumerate(session.calls) if c.trajectory == last]
    info["turn_spans"] = [session.calls[i].span for i in idx]
    info["turn_step_rewards"] = [rewards.get(i) for i in idx[:-1]]
    info["turn_rewards"] = [r for r in info["turn_step_rewards"] if r is not None]
    info["outcome"] = rewards.get(idx[-1], 0.0)
    info["call_rewards"] = {session.calls[i].response_id: r for i, r in rewards.items()}


def attach_agent(roles: Any, cfg: Any) -> Any:
    """An agent run's roles (``env.agent.function`` set): the rollout role becomes an
    :class:`AgentRollout` over the built engine and the reward role an ``EpisodeScorer`` with
    ``outcome: env`` (the score is the agent's reward, 0 for a failed rollout; the reward
    function is :func:`agent_reward`). Once; returns ``roles``, unchanged without an agent."""
    a = cfg.env.agent
    if not a.enabled or isinstance(roles.rollout, AgentRollout):
        return roles
    roles.rollout = AgentRollout(
        roles.rollout,
        roles.tokenizer,
        a.function,
        a.timeout_s,
        a.concurrency,
        a.isolation,
        a.max_sequences_per_request,
    )
    if roles.reward.service is None:
        roles.reward.fn = agent_reward
    roles.reward = EpisodeScorer(roles.reward, "env", 0.0)
    return roles
