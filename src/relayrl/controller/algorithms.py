"""The RL algorithms as short programs over roles, one training step each.

Read top to bottom like the papers' pseudo-code:
GRPO (DeepSeekMath, Shao et al. 2024) and PPO-RLHF (InstructGPT, Ouyang et al. 2022).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from relayrl.algos import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_to_rewards,
    behaviour_weights,
    compute_advantages,
    rollout_correction,
)
from relayrl.config import RunConfig
from relayrl.controller.failures import FailureLog, infra_cause, retry_failed
from relayrl.data import dynamic_sample
from relayrl.data.prompts import TokenizedPrompt
from relayrl.env.export import save_trajectories
from relayrl.env.scoring import expand_episodes
from relayrl.env.turn_credit import turn_advantages
from relayrl.rollout import GenerationRequest, Sample, SamplingParams
from relayrl.telemetry.mismatch import MismatchMonitor
from relayrl.workers import Experience, Roles
from relayrl.workers.teacher import load_teacher

KLController = FixedKLController | AdaptiveKLController


def group_requests(
    prompt: TokenizedPrompt,
    cfg: RunConfig,
    step: int,
    index: int,
    group_id: int,
    stop_ids: list[int],
) -> list[GenerationRequest]:
    """The G requests of one prompt group, each seeded from (run seed, step, index, k)."""
    r = cfg.rollout
    g_size = cfg.algo.group_size
    out = []
    for k in range(g_size):
        seed = (cfg.seed * 1_000_003 + step * 10_007 + index * g_size + k) & 0x7FFFFFFF
        params = SamplingParams(
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_tokens=r.max_tokens,
            stop_token_ids=stop_ids,
            seed=seed,
        )
        meta = {**prompt.fields(), "sample_index": k}
        out.append(GenerationRequest(prompt.ids, params, group_id=group_id, metadata=meta))
    return out


def make_requests(
    prompts: Sequence[TokenizedPrompt], cfg: RunConfig, step: int, stop_ids: list[int]
) -> list[GenerationRequest]:
    """G requests per prompt, one group each (group id = index of the prompt in the step)."""
    return [
        req for g, p in enumerate(prompts) for req in group_requests(p, cfg, step, g, g, stop_ids)
    ]


def last_token_rewards(scores: Tensor, response_mask: Tensor) -> Tensor:
    """Outcome reward placed on each sequence's last response token: r_t = score * [t = T_i]."""
    last = (response_mask.cumsum(-1) == response_mask.sum(-1, keepdim=True)) & (response_mask > 0)
    return scores[:, None] * last.float()


def rollout_and_score(
    roles: Roles, requests: list[GenerationRequest], timer: dict[str, float], retries: int = 0
) -> tuple[list[Sample], Tensor, dict[str, float]]:
    """Generate and score: one sample per request, single-turn or a whole episode (the
    rollout role is then an ``EpisodeRunner`` and the reward role an ``EpisodeScorer``:
    ``controller.schedules.attach_environments``). An infrastructure failure is generated and
    scored again up to ``retries`` times (``controller.failures``; ``failures/retried``)."""
    t0 = time.perf_counter()
    samples = roles.rollout.generate(requests)
    t1 = time.perf_counter()
    scores, reward_stats = roles.reward.score(samples)
    if retries:
        samples, scores, retried = retry_failed(
            roles.rollout, roles.reward, requests, samples, scores, retries
        )
        timer["failures/retried"] = timer.get("failures/retried", 0.0) + retried
    timer["time/generate"] = t1 - t0
    timer["time/score"] = time.perf_counter() - t1
    return samples, scores, reward_stats


def old_logprobs(roles: Roles, exp: Experience, cfg: RunConfig) -> Tensor | None:
    """pi_old of the PPO ratio for this batch.

    - naive PPO on possibly stale data (``policy_loss: ppo`` in ``overlap`` / ``async``):
      the behaviour policy's logprobs, as the engine reported them (the clip is centred on
      the policy that generated the tokens: AReaL's "naive PPO" baseline);
    - one update per step (``recompute_old_logprobs: auto``, epochs = mini_batches = 1):
      None, and the actor takes its own detached logprobs in the update's forward, micro-batch
      by micro-batch: they are the pre-update policy's (``ActorWorker.update``; it computes
      them first itself when its model has dropout). This holds for decoupled PPO's pi_prox
      off the sync schedule too: its ratio pi_theta / pi_prox is then exactly 1 at the
      forward, its behaviour weight exp(pi_prox - pi_behav) the same numbers, one forward
      fewer per step;
    - otherwise the pre-update actor's logprobs, recomputed here (decoupled PPO's proximal
      policy pi_prox; on fresh data equal to the behaviour logprobs).
    """
    a = cfg.algo
    if cfg.policy_loss == "ppo" and cfg.schedule != "sync":
        return exp["behaviour_logprobs"]
    if a.recompute_old_logprobs == "auto" and a.epochs == 1 and a.mini_batches == 1:
        return None
    return roles.actor.compute_logprobs(exp)


def grpo_experience(
    roles: Roles,
    samples: Sequence[Sample],
    scores: Tensor,
    cfg: RunConfig,
    episodes: Sequence[int] | None = None,
) -> Experience:
    """GRPO's batch: pi_old (proximal) and pi_ref logprobs, group-normalised advantages.

    ``episodes``: the episode of each sample (segments of one prefix-broken episode share
    one), so that the group statistics count an episode once (``compute_advantages``)."""
    exp = Experience.from_samples(samples, roles.tokenizer.pad_token_id)
    exp["scores"] = scores
    old = old_logprobs(roles, exp, cfg)
    if old is not None:
        exp["old_logprobs"] = old
    if cfg.algo.kl_coef > 0 and roles.reference is not None:
        exp["ref_logprobs"] = roles.reference.compute_logprobs(exp)
    exp["advantages"], _ = compute_advantages(
        cfg.algo.advantage_name,
        token_rewards=last_token_rewards(scores, exp.response_mask),
        response_mask=exp.response_mask,
        group_index=exp["group_index"],
        episode_index=None if episodes is None else list(episodes),
        **_estimator_kwargs(cfg),
    )
    if cfg.algo.turn_credit == "stepwise_grpo":  # per-turn advantages (multi-turn episodes)
        groups = exp["group_index"].tolist()
        exp["advantages"] = turn_advantages(
            samples, scores, exp.response_mask, groups, cfg.algo.turn_gamma
        )
    if cfg.algo.distill.teacher_path is not None:
        distill_from_teacher(roles, exp, cfg)
    return exp


def distill_from_teacher(roles: Roles, exp: Experience, cfg: RunConfig) -> None:
    """On-policy distillation (``algo.distill``): the teacher scores the student's samples.

    d_t = log pi_student(y_t) - log pi_teacher(y_t), the student's logprob being the engine's
    (the distribution the token was sampled from). ``mode: reward``: A_t <- A_t - coef * d_t
    (or -coef * d_t alone without ``task_reward``); ``mode: loss``: the actor adds
    coef * agg(0.5 d_t^2) on ``exp["teacher_logprobs"]``. The teacher is loaded on first use.
    """
    d = cfg.algo.distill
    if roles.teacher is None:
        roles.teacher = load_teacher(cfg)
    mask = exp.response_mask
    exp["teacher_logprobs"] = teacher = roles.teacher.compute_logprobs(exp)
    if d.mode == "reward":
        reverse_kl = (exp["behaviour_logprobs"] - teacher) * mask
        task = exp["advantages"] if d.task_reward else torch.zeros_like(teacher)
        exp["advantages"] = task - d.coef * reverse_kl


def ppo_experience(
    roles: Roles, samples: Sequence[Sample], scores: Tensor, cfg: RunConfig, kl_ctl: KLController
) -> Experience:
    """PPO-RLHF's batch: r_t = -beta KL_t (+ score on the last token), values, GAE."""
    assert roles.critic is not None and roles.reference is not None, "PPO needs critic and ref"
    exp = Experience.from_samples(samples, roles.tokenizer.pad_token_id)
    exp["scores"] = scores
    exp["old_logprobs"] = roles.actor.compute_logprobs(exp)
    exp["ref_logprobs"] = roles.reference.compute_logprobs(exp)
    exp["values"] = roles.critic.compute_values(exp)
    token_rewards, exp["kl"] = apply_kl_to_rewards(
        scores,
        exp["old_logprobs"],
        exp["ref_logprobs"],
        exp.response_mask,
        kl_ctl.value,
        cfg.algo.kl_kind,
    )
    exp["advantages"], exp["returns"] = compute_advantages(
        cfg.algo.advantage_name,
        token_rewards=token_rewards,
        response_mask=exp.response_mask,
        values=exp["values"],
        group_index=exp["group_index"],
        **_estimator_kwargs(cfg),
    )
    return exp


def make_experience(
    roles: Roles,
    samples: Sequence[Sample],
    scores: Tensor,
    cfg: RunConfig,
    kl_ctl: KLController,
    step: int | None = None,
    failures: FailureLog | None = None,
) -> Experience:
    """The step's batch. Multi-turn samples (``relayrl.env``) carry a loss mask: observation
    tokens are attended to and never trained (``Experience.response_mask``); GAE steps from
    one model token to the next over them. An episode split at a prefix break trains each of
    its segments, each episode counted once in its group's statistics (``expand_episodes``).
    Infrastructure failures are left out first (``FailureLog.admit``: out of the batch, of
    their group's statistics and of the loss normaliser; counted; budgeted)."""
    failures = failures or FailureLog(cfg.failures)
    samples, scores = failures.admit(samples, scores, grouped=cfg.algo.name != "ppo")
    samples, scores, episodes = expand_episodes(samples, scores)
    if step is not None and cfg.train.save_trajectories:  # what this step trains, as JSONL
        save_trajectories(cfg.run_dir, step, samples, scores.tolist(), roles.tokenizer)
    if cfg.algo.name == "ppo":
        exp = ppo_experience(roles, samples, scores, cfg, kl_ctl)
    else:
        split = len(set(episodes)) < len(episodes)
        exp = grpo_experience(roles, samples, scores, cfg, episodes if split else None)
    exp["outcomes"] = roles.reward.outcomes(samples, scores)  # raw verifiable outcome
    return exp


def trainer_logprobs(roles: Roles, exp: Experience, cfg: RunConfig, compute: bool) -> Tensor | None:
    """The trainer's logprobs of the batch at the start of the step (pi_old / pi_prox).

    Reused from ``exp["old_logprobs"]`` when the actor computed them (not for naive PPO off
    the sync schedule, whose pi_old is the engine's). Otherwise, with ``compute``, one actor
    forward; they also become ``old_logprobs`` when the step had none (identical values to the
    update's own detached logprobs), else None.
    """
    naive = cfg.policy_loss == "ppo" and cfg.schedule != "sync"
    if "old_logprobs" in exp and not naive:
        return exp["old_logprobs"]
    if not compute:
        return None
    logprobs = roles.actor.compute_logprobs(exp)
    if "old_logprobs" not in exp:
        exp["old_logprobs"] = logprobs
    return logprobs


def correct_rollout(roles: Roles, exp: Experience, cfg: RunConfig) -> dict[str, float]:
    """Train / inference mismatch: monitor it, and weight the policy loss when configured.

    rho = pi_trainer / pi_engine of every sampled token (``relayrl.algos.rollout_correction``).
    With ``algo.rollout_correction`` enabled its weights go to ``exp["rollout_weights"]``,
    which the actor multiplies into the policy loss (of any ``algo.policy_loss``). Whenever
    the trainer's logprobs exist anyway the ``rollout_corr/*`` mismatch stats are logged,
    correction or not (mode ``none`` reports them without weighting anything).
    """
    rc = cfg.algo.rollout_correction
    behav = needs_behaviour_weight(cfg)
    trainer = trainer_logprobs(roles, exp, cfg, compute=rc.enabled or behav)
    if trainer is None:
        return {}
    weights, stats = rollout_correction(
        trainer,
        exp["behaviour_logprobs"],
        exp.response_mask,
        mode=rc.mode,
        level=rc.level,
        cap=rc.cap,
        lower=rc.lower,
        upper=rc.upper,
        batch_normalize=rc.batch_normalize,
        reject_kl=rc.reject_kl,
        kl_estimator=rc.kl_estimator,
        kl_agg=rc.kl_agg,
        mismatch_threshold=rc.mismatch_threshold,
    )
    if rc.enabled:
        exp["rollout_weights"] = weights.to(torch.float32)
    if behav:
        a = cfg.algo
        factor, w, affected = behaviour_weights(
            trainer, exp["behaviour_logprobs"], exp.response_mask,
            a.behav_weight_mode, a.behav_weight_cap, a.behav_weight_lower,
        )  # fmt: skip
        prior = exp["rollout_weights"] if rc.enabled else 1.0  # reject_kl's rejections
        exp["rollout_weights"] = (factor * prior).to(torch.float32)
        mask = exp.response_mask.bool()
        n = mask.sum().clamp(min=1)
        stats["offpolicy/behav_weight_mean"] = float(w[mask].sum() / n)
        stats["offpolicy/behav_weight_max"] = float(w[mask].max()) if mask.any() else 0.0
        stats["offpolicy/capped_frac"] = float(affected.sum() / n)
    return stats


def needs_behaviour_weight(cfg: RunConfig) -> bool:
    """Whether a 2025 loss (gspo, cispo, sapo, gmpo, ...) gets decoupled PPO's behaviour
    weight from :func:`correct_rollout`: off the sync schedule (data can be stale, so the
    off-policy correction is on by default, as ``decoupled_ppo`` is) unless
    ``algo.rollout_correction.mode`` is set, whose weight (the same ratio pi_prox / pi_behav)
    then replaces it, as for decoupled PPO. The weight is f(w), w = exp(pi_prox - pi_behav),
    f from ``algo.behav_weight_mode`` / ``behav_weight_cap`` / ``behav_weight_lower``."""
    return (
        cfg.schedule != "sync"
        and cfg.policy_loss not in ("ppo", "decoupled_ppo")
        and cfg.algo.rollout_correction.mode == "none"
    )


def update_roles(
    roles: Roles,
    exp: Experience,
    cfg: RunConfig,
    kl_ctl: KLController,
    mismatch: MismatchMonitor | None = None,
    version: int | None = None,
) -> dict[str, float]:
    """One training step on ``exp``: rollout correction, critic first (PPO), then the actor;
    adapt beta. With ``mismatch`` the train/inference mismatch of the tokens generated under
    the trainer's weights (``version``) is logged (``mismatch/*``, a warning when it jumps)
    whenever the step has the trainer's logprobs before the update (several mini-batches or
    epochs, ``recompute_old_logprobs: always``, a rollout correction); with one update per
    step, decoupled PPO's included, pi_old comes from the update's own forward and there is
    none to compare (``old_logprobs``)."""
    stats: dict[str, float] = correct_rollout(roles, exp, cfg)
    naive = cfg.policy_loss == "ppo" and cfg.schedule != "sync"  # pi_old is the engine's
    if mismatch is not None and "old_logprobs" in exp and not naive:
        stats.update(
            mismatch.observe(
                exp["behaviour_logprobs"],
                exp["old_logprobs"],
                exp.response_mask,
                exp["versions"] if "versions" in exp else None,
                version,
                step=version,
            )
        )
    if "teacher_logprobs" in exp:
        mask = exp.response_mask
        gap = (exp["behaviour_logprobs"] - exp["teacher_logprobs"]) * mask
        stats["distill/reverse_kl"] = float(gap.sum() / mask.sum().clamp(min=1))
    if roles.critic is not None and "returns" in exp:
        stats.update(roles.critic.update(exp))
    stats.update(roles.actor.update(exp))
    if "kl" in exp:
        mean_kl = kl_for_controller(exp["kl"], exp.response_mask, cfg.algo.adaptive_kl_metric)
        kl_ctl.update(mean_kl, len(exp))
        stats["kl_in_reward"] = mean_kl
        stats["kl_beta"] = float(kl_ctl.value)
    return stats


def kl_for_controller(kl: Tensor, response_mask: Tensor, metric: str) -> float:
    """The step's KL for the adaptive controller: the mean over all valid tokens
    (``token-mean``, relayrl) or the mean over sequences of each one's token mean
    (``seq-mean``, veRL's ``mean(masked_mean(kl, mask, axis=-1))``; an empty row counts 0)."""
    mask = response_mask.to(kl.dtype)
    if metric == "seq-mean":
        per_seq = (kl * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        return float(per_seq.mean()) if len(per_seq) else 0.0
    return float((kl * mask).sum() / mask.sum().clamp(min=1))


def rl_step(
    roles: Roles,
    prompts: Sequence[TokenizedPrompt],
    cfg: RunConfig,
    step: int,
    stop_ids: list[int],
    kl_ctl: KLController,
    refill: Callable[[int, int], Sequence[TokenizedPrompt]] | None = None,
    mismatch: MismatchMonitor | None = None,
    failures: FailureLog | None = None,
) -> tuple[Experience, dict[str, float]]:
    """One synchronous step: generate G answers per prompt, score, build the batch, train.

    With ``data.dynamic_sampling.enabled`` (DAPO) groups whose raw outcomes are all equal are
    dropped and ``refill(round, n)`` supplies prompts for more rounds (see ``dynamic_rollout``).
    Infrastructure failures are retried, then left out and counted (``failures``, the run's
    ``FailureLog``: ``failures/*`` in the stats).
    """
    timer: dict[str, float] = {}
    failures = failures or FailureLog(cfg.failures)
    if cfg.data.dynamic_sampling.enabled:
        samples, scores, stats = dynamic_rollout(roles, prompts, cfg, step, stop_ids, timer, refill)
    else:
        requests = make_requests(prompts, cfg, step, stop_ids)
        samples, scores, stats = rollout_and_score(roles, requests, timer, cfg.failures.retries)
    t0 = time.perf_counter()
    exp = make_experience(roles, samples, scores, cfg, kl_ctl, step=step, failures=failures)
    stats.update(failures.metrics())
    stats.update(update_roles(roles, exp, cfg, kl_ctl, mismatch, step))
    timer["time/train"] = time.perf_counter() - t0
    stats.update(timer)
    return exp, stats


def group_outcomes(group: Sequence[tuple[Sample, float]]) -> list[float]:
    """The raw outcomes of a scored group (before reward mixing): what dynamic sampling
    tests for variance. Infrastructure failures are no outcome (``controller.failures``)."""
    return [
        float(s.metadata.get("reward", {}).get("outcome", v))
        for s, v in group
        if infra_cause(s) is None
    ]


REFILL_STEP_BASE = 10_000_000


def refill_prompts(
    source: Any, step: int, max_rounds: int
) -> Callable[[int, int], Sequence[TokenizedPrompt]]:
    """Prompts for dynamic-sampling round r >= 1 of ``step``: ``source.for_step`` at step
    indices no training step uses, so refills are fresh and resume-exact."""
    return lambda rnd, n: source.for_step(REFILL_STEP_BASE + step * max_rounds + rnd, n)


def dynamic_rollout(
    roles: Roles,
    prompts: Sequence[TokenizedPrompt],
    cfg: RunConfig,
    step: int,
    stop_ids: list[int],
    timer: dict[str, float],
    refill: Callable[[int, int], Sequence[TokenizedPrompt]] | None,
) -> tuple[list[Sample], Tensor, dict[str, float]]:
    """DAPO dynamic sampling: keep groups whose raw verifiable outcomes differ, refill until
    ``prompts_per_step`` groups or ``max_rounds`` rounds; log ``dynamic/dropped_frac``.

    The outcome of a sample is the reward service's raw ``outcome`` when recorded, else its
    score. Kept groups are renumbered 0..B-1. If no group is kept, round 0's groups are used
    (all-zero advantages: the update only moves the KL and entropy terms).
    """
    timer["time/generate"] = timer["time/score"] = 0.0
    first: dict[str, Any] = {}

    def generate(rnd: int, n: int) -> list[list[tuple[Sample, float]]]:
        batch = list(prompts) if rnd == 0 else list(refill(rnd, n) if refill else [])
        if not batch:
            return []
        sub: dict[str, float] = {}
        samples, scores, stats = rollout_and_score(
            roles, make_requests(batch, cfg, step, stop_ids), sub, cfg.failures.retries
        )
        timer["failures/retried"] = timer.get("failures/retried", 0.0)
        timer["failures/retried"] += sub.get("failures/retried", 0.0)
        timer["time/generate"] += sub["time/generate"]
        timer["time/score"] += sub["time/score"]
        groups: dict[Any, list[tuple[Sample, float]]] = {}
        for sample, value in zip(samples, scores.tolist(), strict=True):
            groups.setdefault(sample.group_id, []).append((sample, value))
        if rnd == 0:
            first.update(stats=stats, groups=list(groups.values()), scores=scores)
        return list(groups.values())

    kept, ds = dynamic_sample(
        generate, group_outcomes, len(prompts), cfg.data.dynamic_sampling.max_rounds
    )
    if not kept:
        kept = first.get("groups", [])
    samples, values = [], []
    for new_id, group in enumerate(kept):
        for sample, value in group:
            sample.group_id = new_id
            samples.append(sample)
            values.append(value)
    stats = dict(first.get("stats", {}))
    stats.update(ds.as_metrics())
    if "scores" in first:
        stats["dynamic/raw_pass_rate"] = float((first["scores"] >= 1.0).float().mean())
    return samples, torch.tensor(values, dtype=torch.float32), stats


def _estimator_kwargs(cfg: RunConfig) -> dict[str, Any]:
    a = cfg.algo
    name = a.advantage_name
    if name == "gae":
        return {"gamma": a.gamma, "lam": a.lam, "whiten": a.whiten_advantages}
    if name == "grpo":
        return {"norm_by_std": a.norm_by_std, "singleton": a.singleton_advantage}
    if name == "drgrpo":
        return {"singleton": a.singleton_advantage}
    if name == "reinforce_plus_plus_baseline":
        return {
            "gamma": a.gamma,
            "target": a.rfpp_baseline_target,
            "singleton": a.singleton_advantage,
        }
    if name.startswith("reinforce"):
        return {"gamma": a.gamma}
    return {}


def make_kl_controller(cfg: RunConfig) -> KLController:
    a = cfg.algo
    if a.adaptive_kl_target is not None:
        return AdaptiveKLController(a.kl_coef, a.adaptive_kl_target, a.adaptive_kl_horizon)
    return FixedKLController(a.kl_coef)


@torch.no_grad()
def rollout_stats(exp: Experience) -> dict[str, float]:
    scores = exp["scores"]
    outcomes = exp.tensors.get("outcomes", scores)
    return {
        "reward_mean": float(scores.mean()),
        "pass_rate": float((outcomes >= 1.0).float().mean()),
        **exp.meta(),
    }
