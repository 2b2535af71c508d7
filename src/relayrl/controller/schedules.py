"""Schedules: where a training step's batch comes from and when weights move.

A schedule runs the algorithm's one step function (``controller.algorithms``: ``grpo_step``,
``ppo_step``) and serves it what differs between schedules (``StepSchedule``): ``rollout``
(phases 1-2, the scored samples), ``bound_staleness`` and ``sync_weights`` (phase 6).

``SyncSchedule``: generate the step's groups with the current weights, then train (one
process). ``AsyncSchedule`` (``overlap`` = eta 1 without interruption, ``async`` = eta and
interrupt from the config): the engine worker generates continuously under the staleness gate
while the trainer trains; each step takes the B oldest finished groups from the buffer,
checks every token's staleness, trains and pushes the new weights with their version.

Multi-turn episodes (``env.factory``) run through the same schedules: ``attach_environments``
wraps the rollout role in an ``EpisodeRunner`` (engine-shaped: each request is an episode,
each finished episode one sample with a loss mask) and the reward role in an
``EpisodeScorer``; nothing else in a schedule knows whether a sample had one turn or many.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from relayrl.config import RunConfig
from relayrl.controller.algorithms import (
    KLController,
    make_requests,
    rollout_and_score,
    rollout_progress,
    step_function,
)
from relayrl.controller.buffer import GroupBuffer
from relayrl.controller.dynamic_sampling import (
    dynamic_rollout,
    refill_prompts,
    regenerate_small_groups,
)
from relayrl.controller.failures import FailureLog, infra_cause
from relayrl.controller.rollout_controller import RolloutController
from relayrl.controller.staleness import StalenessGate
from relayrl.controller.watchdog import run_watched
from relayrl.data.prompts import PromptSource
from relayrl.env.registry import resolve_factory
from relayrl.env.render import make_renderer
from relayrl.env.runner import EpisodeRunner, RunnerLimits
from relayrl.env.scoring import EpisodeScorer
from relayrl.rollout import EpisodeMetrics, PollingBackend, Sample, driven
from relayrl.telemetry.mismatch import MismatchMonitor
from relayrl.telemetry.timeline import Timeline
from relayrl.workers import Experience, Roles


def attach_environments(roles: Roles, cfg: RunConfig) -> None:
    """With ``env.factory``: the rollout role becomes an ``EpisodeRunner`` over the engine and
    the reward role an ``EpisodeScorer`` over the reward worker (once; a no-op without an
    environment or when already attached). The held-out evaluation, which uses the same roles,
    then runs episodes too."""
    e = cfg.env
    if not e.enabled or isinstance(roles.rollout, EpisodeRunner):
        return
    factory = resolve_factory(e.factory or "", e.kwargs)
    roles.rollout = EpisodeRunner(
        driven(roles.rollout),
        factory,
        make_renderer(roles.tokenizer, e.render),
        RunnerLimits.from_config(e, _context_length(roles)),
        concurrency=e.concurrency,
        reuse=e.reuse,
        isolation=e.isolation,
    )
    roles.reward = EpisodeScorer(roles.reward, e.outcome, e.turn_reward_coef)


def _context_length(roles: Roles) -> int:
    """The engine's context (``max_model_len``), else the actor model's positions."""
    n = roles.rollout.max_model_len
    if n is None:
        config = getattr(roles.actor.model, "config", None)
        n = getattr(config, "max_position_embeddings", None)
    if n is None:
        raise ValueError("env: cannot tell the model's context length (max_position_embeddings)")
    return int(n)


def env_metrics(roles: Roles) -> dict[str, float]:
    """The episode runner's ``env/*`` counters since the last call (none single-turn). The
    sync schedule counts its own step's episodes; the async ones count every episode that
    finished since the previous step (an ``train.eval_every`` evaluation's too)."""
    if isinstance(roles.rollout, EpisodeMetrics):  # EpisodeRunner, AgentRollout (i20b)
        return roles.rollout.env_metrics()
    return {}


class SyncSchedule:
    def __init__(
        self,
        roles: Roles,
        cfg: RunConfig,
        source: PromptSource,
        stop_ids: list[int],
        timeline: Timeline,
    ):
        self.roles, self.cfg, self.source, self.stop_ids = roles, cfg, source, stop_ids
        self.timeline = timeline
        self.algorithm = step_function(cfg)  # grpo_step or ppo_step
        self._engine_counts = (0, 0)
        self.mismatch = MismatchMonitor()  # engine vs trainer logprobs, per step
        self.failures = FailureLog(cfg.failures)  # infrastructure failures: counts, budget

    def start(self, step: int, state: dict[str, Any] | None = None) -> None:
        self._engine_counts = self._slot_counts()

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the schedule: nothing (step k's prompts follow from k)."""
        return {}

    def _slot_counts(self) -> tuple[int, int]:
        """(engine steps, slot steps) so far, summed over the engine's replicas."""
        st = self.roles.rollout.report().counters
        return int(st.get("steps", 0)), int(st.get("slot_steps", 0))

    def step(self, step: int, kl_ctl: KLController) -> tuple[Experience, dict[str, float]]:
        """The algorithm's step, then this step's idle fraction, episodes and slot use."""
        env_metrics(self.roles)  # drop what an evaluation between steps counted
        exp, stats = self.algorithm(self.roles, self.cfg, self, step, kl_ctl)
        stats["trainer_idle_frac"] = stats["time/generate"] / max(
            stats["time/generate"] + stats["time/score"] + stats["time/train"], 1e-9
        )
        stats.update(env_metrics(self.roles))
        # slot utilisation of this step's generation: the straggler tail leaves slots empty
        (s0, u0), (s1, u1) = self._engine_counts, self._slot_counts()
        self._engine_counts = (s1, u1)
        if s1 > s0:
            stats["engine_slot_utilisation"] = (u1 - u0) / ((s1 - s0) * self.cfg.rollout.max_slots)
        return exp, stats

    def rollout(self, step: int) -> tuple[list[Sample], torch.Tensor, dict[str, float]]:
        """Phases 1-2 now, with the current weights: the step's prompts (a seeded draw that
        depends only on (seed, step)), G requests each, generated and scored; with
        ``data.dynamic_sampling.enabled`` (DAPO) flat groups dropped and refilled
        (``dynamic_rollout``). Infrastructure failures are retried (``failures.retries``); a
        group they leave with fewer than 2 samples is regenerated with a fresh prompt
        (``regenerate_small_groups``, GRPO-style estimators; ``failures/groups_regenerated``).
        Watched: no progress for ``failures.stall_s`` is a ``RolloutStalled`` naming the phase
        that is stuck (``controller.watchdog``)."""
        t0 = time.perf_counter()
        samples, scores, stats = run_watched(
            lambda mark: self._rollout(step, mark), self.cfg.failures.stall_s, self._progress
        )
        t1 = t0 + stats["time/generate"]
        self.timeline.add("rollout", "generate", t0, t1)
        self.timeline.add("reward", "score", t1, t1 + stats["time/score"])
        return samples, scores, stats

    def _rollout(
        self, step: int, mark: Callable[[str], None]
    ) -> tuple[list[Sample], torch.Tensor, dict[str, float]]:
        cfg = self.cfg
        prompts = self.source.for_step(step, cfg.algo.prompts_per_step)
        timer: dict[str, float] = {}
        if cfg.data.dynamic_sampling.enabled:
            refill = refill_prompts(self.source, step, cfg.data.dynamic_sampling.max_rounds)
            samples, scores, stats = dynamic_rollout(
                self.roles, prompts, cfg, step, self.stop_ids, timer, refill, mark
            )
        else:
            requests = make_requests(prompts, cfg, step, self.stop_ids)
            samples, scores, stats = rollout_and_score(
                self.roles, requests, timer, cfg.failures.retries, mark
            )
            if cfg.algo.name != "ppo":  # a group baseline needs 2 samples (FailureLog.admit)
                samples, scores, n = regenerate_small_groups(
                    self.roles, cfg, step, self.stop_ids, samples, scores, self.source, timer, mark
                )
                self.failures.count_regenerated(n)
        stats.update(timer)
        return samples, scores, stats

    def _progress(self) -> tuple[int, ...]:
        """What moves while a phase is under way: the engine's generated tokens and finished
        requests, the reward role's scored samples."""
        return rollout_progress(self.roles)

    def bound_staleness(self, exp: Experience, step: int) -> dict[str, float]:
        """Fresh data: every token was generated by the weights being trained."""
        return {"staleness_max": 0.0, "staleness_mean": 0.0}

    def sync_weights(self, step: int, trained: tuple[float, float]) -> dict[str, float]:
        """The actor's weights into the engine as version ``step + 1`` (no request in flight)."""
        self.timeline.add("trainer", "train", *trained)
        with self.timeline.span("trainer", "weight_sync"):
            t_sync = time.perf_counter()
            self.roles.rollout.update_weights(
                self.roles.actor.state_dict(), version=step + 1, interrupt=False
            )
            return {"time/weight_sync": time.perf_counter() - t_sync}

    def close(self) -> dict[str, Any]:
        """The engine's counters since it started (as the async schedule's ``engine``)."""
        try:
            return {"engine": self.roles.rollout.report().counters}
        except Exception:  # closing must not mask the first error
            return {}


class AsyncSchedule:
    def __init__(
        self,
        roles: Roles,
        cfg: RunConfig,
        source: PromptSource,
        stop_ids: list[int],
        timeline: Timeline,
    ):
        self.roles, self.cfg, self.timeline = roles, cfg, timeline
        self.gate = StalenessGate(cfg.algo.prompts_per_step, cfg.staleness_eta)
        self.buffer = GroupBuffer(in_order=cfg.async_.in_order)
        if not isinstance(roles.rollout, PollingBackend):
            raise TypeError(
                f"schedule={cfg.schedule}: the rollout backend {type(roles.rollout).__name__} "
                "is not a PollingBackend (an engine in its own process or on Ray)"
            )
        self.controller = RolloutController(
            roles.rollout, source, roles.reward, cfg, self.gate, self.buffer, stop_ids, timeline
        )
        self.staleness_hist: Counter[int] = Counter()
        self.mismatch = MismatchMonitor()  # engine vs trainer logprobs of fresh tokens
        self.failures = FailureLog(cfg.failures)  # infrastructure failures: counts, budget
        self.algorithm = step_function(cfg)  # grpo_step or ppo_step
        self._retried = 0
        self._regenerated = 0
        self._ds_counts = (0, 0)  # the controller's (groups dropped, completed) at the last step
        self._waited = 0.0
        self._wall0 = 0.0
        self._idle = 0.0
        self._engine_busy = 0.0
        self._interrupted_frac = 0.0

    def start(self, step: int, state: dict[str, Any] | None = None) -> None:
        """Re-base the gate on the (resumed) trainer version and start generating.

        The gate counts step x B groups as admitted (staleness is counted in versions); the
        admission ids (prompt positions, seeds) continue at the checkpoint's ``next_group``,
        which runs ahead of step x B by the groups dynamic sampling dropped, so a resumed run
        neither revisits a trained prompt nor re-trains one.
        """
        self.gate.rebase(step)
        state = state or {}
        self.controller.rebase(
            int(state.get("next_group", self.gate.n_admitted)), state.get("trained_above")
        )
        self._wall0 = time.perf_counter()
        env_metrics(self.roles)  # drop what the evaluation before the start counted
        self.controller.start()

    def step(self, step: int, kl_ctl: KLController) -> tuple[Experience, dict[str, float]]:
        """The algorithm's step, then the engine's and the buffer's figures."""
        cfg = self.cfg
        exp, stats = self.algorithm(self.roles, cfg, self, step, kl_ctl)
        waited = self._waited
        report = self.roles.rollout.report()
        engine_stats, spans = report.counters, report.busy_spans
        for s0, e0 in spans:
            self.timeline.add("rollout", "generate", s0, e0)
        # only busy time since this schedule started (the initial eval ran before)
        self._engine_busy += sum(max(0.0, e0 - max(s0, self._wall0)) for s0, e0 in spans)
        stats["gen_tokens_per_s"] = float(engine_stats["tokens_per_s"])
        stats["engine_slot_utilisation"] = float(engine_stats["mean_slot_utilisation"])
        stats["engine_busy_frac"] = self._engine_busy / max(time.perf_counter() - self._wall0, 1e-9)
        stats["time/wait"] = waited
        stats.update(env_metrics(self.roles))
        stats["trainer_idle_frac"] = self._idle / max(time.perf_counter() - self._wall0, 1e-9)
        c = self.controller
        stats["interrupted_frac"] = self._interrupted_frac
        stats["failures/retried"] = float(c.samples_retried - self._retried)  # since last step
        self._retried = c.samples_retried
        if cfg.algo.name != "ppo" and not cfg.data.dynamic_sampling.enabled:
            stats["failures/groups_regenerated"] = float(c.groups_regenerated - self._regenerated)
            self._regenerated = c.groups_regenerated
        stats["groups_admitted"] = float(self.gate.n_admitted)
        stats["next_group"] = float(self.buffer.next_index)
        if cfg.data.dynamic_sampling.enabled:
            stats["dynamic/dropped_frac"] = self._dropped_frac()
        return exp, stats

    def _dropped_frac(self) -> float:
        """``dynamic/dropped_frac`` of the groups completed since the previous step, as the
        sync schedule's of its step's: (dropped since then) / (completed since then), 0 when
        none completed. Dropped is read first: a group is counted completed before dropped."""
        dropped = self.controller.groups_dropped
        completed = self.controller.groups_completed
        d0, c0 = self._ds_counts
        self._ds_counts = (dropped, completed)
        return (dropped - d0) / (completed - c0) if completed > c0 else 0.0

    def rollout(self, step: int) -> tuple[list[Sample], torch.Tensor, dict[str, float]]:
        """Phases 1-2 happened in the engine worker and the reward service: the B oldest
        finished, scored groups of the buffer (waiting for them is the trainer's idle time)."""
        with self.timeline.span("trainer", "wait"):
            groups, waited = self.buffer.wait_time(
                self.cfg.algo.prompts_per_step, self.controller.check
            )
        self._idle += waited
        self._waited = waited
        samples = [s for g in groups for s in g.samples]
        # interrupted_frac: of this step's samples that train (infrastructure failures are left
        # out), the fraction whose generation a weight update interrupted (num_interrupts > 0)
        kept = [s for s in samples if infra_cause(s) is None]
        self._interrupted_frac = sum(s.num_interrupts > 0 for s in kept) / max(len(kept), 1)
        return samples, torch.cat([g.scores for g in groups]), {}

    def sync_weights(self, step: int, trained: tuple[float, float]) -> dict[str, float]:
        """Weights first, then open the gate: every group admitted under version i + 1 is
        queued behind the update, so the engine never generates it with older weights."""
        self.timeline.add("trainer", "train", *trained)
        with self.timeline.span("trainer", "weight_sync"):
            t1 = time.perf_counter()
            self.roles.rollout.update_weights(
                self.roles.actor.state_dict(), version=step + 1, interrupt=self.cfg.interrupt
            )
            self.controller.set_version(step + 1)
            return {"time/weight_sync": time.perf_counter() - t1}

    def bound_staleness(self, exp: Experience, step: int) -> dict[str, float]:
        """Record staleness = trainer version - token version; enforce max_token_staleness.

        Counted per trained token: ``response_mask`` is 0 on observation tokens of multi-turn
        samples (their version is a placeholder), so they never count or get dropped."""
        mask = exp.response_mask > 0
        assert exp.versions is not None
        stale = (step - exp.versions).masked_fill(~mask, 0)
        values = stale[mask]
        self.staleness_hist.update(values.tolist())
        out = {
            "staleness_mean": float(values.float().mean()) if values.numel() else 0.0,
            "staleness_max": float(values.max()) if values.numel() else 0.0,
        }
        limit = self.cfg.async_.max_token_staleness
        if limit is not None:
            over = (stale > limit) & mask
            factor = 0.0 if self.cfg.async_.stale_tokens == "drop" else self.cfg.async_.stale_weight
            assert exp.advantages is not None
            exp.advantages = torch.where(over, exp.advantages * factor, exp.advantages)
            out["stale_token_frac"] = float(over.sum()) / max(float(mask.sum()), 1.0)
        return out

    def state(self) -> dict[str, Any]:
        """The lowest admission id not yet trained (``next_group``) and the ids above it that
        were (finish order runs ahead of stragglers; a resume trains those, nothing twice)."""
        return self.buffer.state()

    def close(self) -> dict[str, Any]:
        self.controller.stop()
        self.controller.join(timeout=30)
        out: dict[str, Any] = {"staleness_hist": dict(sorted(self.staleness_hist.items()))}
        try:
            report = self.roles.rollout.report()
            for s, e in report.busy_spans:
                self.timeline.add("rollout", "generate", s, e)
            out["engine"] = report.counters
        except Exception:  # the engine may be dead: closing must not mask the first error
            pass
        return out


def attach_episodes(roles: Roles, cfg: RunConfig) -> Roles:
    """The roles of a run with ``env.factory`` (episodes through the environment runner) or
    ``env.agent.function`` (an agent against the endpoint); unchanged without either. Used by
    training and by ``relayrl eval``, so both evaluate the same episodes."""
    attach_environments(roles, cfg)
    if cfg.env.agent.enabled:  # an agent written against the openai client (i20b)
        from relayrl.env.agent_rollout import attach_agent  # fastapi, uvicorn: only then

        attach_agent(roles, cfg)
    return roles


def make_schedule(
    roles: Roles, cfg: RunConfig, source: PromptSource, stop_ids: list[int], timeline: Timeline
) -> SyncSchedule | AsyncSchedule:
    """The run's schedule; with ``env.factory`` the roles are given environments first."""
    attach_episodes(roles, cfg)
    if cfg.schedule == "sync":
        return SyncSchedule(roles, cfg, source, stop_ids, timeline)
    return AsyncSchedule(roles, cfg, source, stop_ids, timeline)
