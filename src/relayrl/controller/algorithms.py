"""The RL algorithms as short programs over roles: one function per training step.

Read top to bottom like the papers' pseudo-code, each in numbered phases:
:func:`grpo_step` (GRPO, DeepSeekMath, Shao et al. 2024) and :func:`ppo_step` (PPO-RLHF,
InstructGPT, Ouyang et al. 2022). The same function serves every schedule: the schedule
(``controller.schedules``, a :class:`StepSchedule`) says where the scored samples come from
(sync: generated now with the current weights; overlap / async: the oldest finished groups of
the buffer), bounds their staleness and moves the new weights to the engine. pi_old and the
off-policy correction weights are decided in one module, ``controller.offpolicy``. Run
management (run directory, signals, checkpoints, logging) is ``controller.trainer``'s.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from relayrl.algos import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_to_rewards,
    compute_advantages,
)
from relayrl.config import RunConfig
from relayrl.controller import offpolicy
from relayrl.controller.failures import FailureLog, renormalized, retry_failed
from relayrl.controller.watchdog import no_mark
from relayrl.data.prompts import TokenizedPrompt
from relayrl.env.export import save_trajectories
from relayrl.env.scoring import expand_episodes
from relayrl.env.turn_credit import turn_advantages
from relayrl.reward.functions import fn_name
from relayrl.rollout import GenerationRequest, Sample, SamplingParams
from relayrl.telemetry.mismatch import MismatchMonitor
from relayrl.workers import Experience, Roles
from relayrl.workers.teacher import load_teacher

KLController = FixedKLController | AdaptiveKLController


class StepSchedule(Protocol):
    """What a step asks of its schedule (``controller.schedules``)."""

    failures: FailureLog  # infrastructure failures: counts, budget
    mismatch: MismatchMonitor  # engine vs trainer logprobs

    def rollout(self, step: int) -> tuple[list[Sample], Tensor, dict[str, float]]:
        """Phases 1-2: the step's scored samples, their scores and the stats so far."""
        ...

    def bound_staleness(self, exp: Experience, step: int) -> dict[str, float]:
        """Staleness stats; stale tokens' advantages dropped or down-weighted (async)."""
        ...

    def sync_weights(self, step: int, trained: tuple[float, float]) -> dict[str, float]:
        """Phase 6: the actor's weights to the engine as version ``step + 1`` (``trained``:
        the perf-counter span of phases 3-5, for the timeline)."""
        ...


def grpo_step(
    roles: Roles, cfg: RunConfig, schedule: StepSchedule, step: int, kl_ctl: KLController
) -> tuple[Experience, dict[str, float]]:
    """One GRPO step: G answers per prompt, group-normalised outcome advantages, clipped update.

    Also DAPO / Dr.GRPO / RLOO / REINFORCE++ (``algo.advantage``), any registered policy loss
    (``algo.policy_loss``), multi-turn episodes (``env``) and on-policy distillation
    (``algo.distill``). ``kl_ctl``: beta of the KL to the reference (``algo.kl_in``: a loss
    term by default, or in the token rewards), adapted with ``algo.adaptive_kl_target``.
    """
    a = cfg.algo
    # 1-2. Generate and score (schedule): G = algo.group_size answers per prompt, each with its
    #      reward; infrastructure failures left out, episodes split at a prefix break expanded;
    #      algo.missing_eos_penalty taken off the truncated ones.
    samples, scores, stats = schedule.rollout(step)
    t0 = time.perf_counter()
    samples, scores, episodes = admit(roles, cfg, schedule.failures, samples, scores, step)
    exp = scored_experience(roles, cfg, samples, scores, episodes, stats)
    assert exp.scores is not None
    scores = exp.scores  # what trains (the raw outcomes: exp.outcomes)

    # 3. Reference and proximal logprobs: pi_old (None: the update's own forward; see
    #    offpolicy.old_logprobs; now when the KL is in the reward), log pi_ref when kl_coef > 0.
    in_reward = a.kl_placement == "reward" and a.kl_coef > 0 and roles.reference is not None
    exp.old_logprobs = offpolicy.old_logprobs(roles, exp, cfg, needed_now=in_reward)
    if a.kl_coef > 0 and roles.reference is not None:
        exp.ref_logprobs = roles.reference.compute_logprobs(exp)

    # 4. Advantages: r_t = score * [t = T] (- beta * KL_t(pi_old || pi_ref) with the KL in the
    #    reward); A_i = (R_i - mean_g R) / (std_g R + eps) over answer i's group g of the
    #    returns R_i = sum_t r_t, on each of its tokens (an episode counted once; under
    #    REINFORCE++(-baseline) the return-to-go runs along its rows, score on the last).
    split = len(set(episodes)) < len(episodes)
    exp.advantages, _ = compute_advantages(
        a.advantage_name,
        token_rewards=kl_shaped_rewards(exp, cfg, kl_ctl, episodes if split else None)
        if in_reward
        else last_token_rewards(
            row_outcomes(scores, exp.response_mask, episodes, a.advantage_name),
            exp.response_mask,
        ),
        response_mask=exp.response_mask,
        group_index=exp.group_index,
        episode_index=list(episodes) if split else None,
        **_estimator_kwargs(cfg),
    )
    if a.turn_credit == "stepwise_grpo":  # per-turn advantages (multi-turn episodes)
        assert exp.group_index is not None
        exp.advantages = turn_advantages(
            samples, scores, exp.response_mask, exp.group_index.tolist(), a.turn_gamma
        )
    if a.distill.teacher_path is not None:
        distill_from_teacher(roles, exp, cfg)
    set_kl_loss_coef(exp, cfg, kl_ctl)
    stats.update(schedule.bound_staleness(exp, step))
    stats.update(schedule.failures.metrics())

    # 5. Update: the off-policy correction weights and mismatch stats (offpolicy.correct),
    #    then the actor's epochs x mini-batches of the registered policy loss.
    stats.update(offpolicy.correct(roles, exp, cfg, schedule.mismatch, step))
    if exp.teacher_logprobs is not None:
        stats["distill/reverse_kl"] = distill_gap(exp)
    stats.update(roles.actor.update(exp))
    adapt_kl(exp, cfg, kl_ctl, stats)
    t1 = time.perf_counter()
    stats["time/train"] = t1 - t0

    # 6. Weight sync: the new weights reach the engine as version step + 1.
    stats.update(schedule.sync_weights(step, (t0, t1)))
    return exp, stats


def ppo_step(
    roles: Roles, cfg: RunConfig, schedule: StepSchedule, step: int, kl_ctl: KLController
) -> tuple[Experience, dict[str, float]]:
    """One PPO-RLHF step: r_t = -beta KL_t (+ the score on the last token), values, GAE,
    critic then actor update, beta adapted (``algo.adaptive_kl_target``). With
    ``algo.kl_in: loss`` the rewards carry the score only and the actor loss the KL term."""
    a = cfg.algo
    assert roles.critic is not None and roles.reference is not None, "PPO needs critic and ref"
    # 1-2. Generate and score (schedule): one answer per prompt (or algo.group_size), each
    #      with its reward; infrastructure failures left out; algo.missing_eos_penalty taken
    #      off the truncated ones.
    samples, scores, stats = schedule.rollout(step)
    t0 = time.perf_counter()
    samples, scores, episodes = admit(roles, cfg, schedule.failures, samples, scores, step)
    exp = scored_experience(roles, cfg, samples, scores, episodes, stats)

    # 3. Reference and proximal logprobs: pi_old (now when the KL in the reward reads it),
    #    pi_ref, and the critic's values V(s_t) before the update.
    in_reward = a.kl_placement == "reward"
    exp.old_logprobs = offpolicy.old_logprobs(roles, exp, cfg, needed_now=in_reward)
    exp.ref_logprobs = roles.reference.compute_logprobs(exp)
    exp.values = roles.critic.compute_values(exp)

    # 4. Advantages: r_t = -beta * KL_t(pi_old || pi_ref) + score * [t = T] (the KL in the
    #    loss: the score alone); GAE(gamma, lambda) gives A_t and the critic's targets
    #    R_t = A_t + V_t. An episode split into rows: GAE runs along its rows in order and
    #    its score sits on its last row only (row_outcomes), as if it were one sequence.
    assert exp.scores is not None
    split = len(set(episodes)) < len(episodes)
    exp.advantages, exp.returns = compute_advantages(
        a.advantage_name,
        token_rewards=kl_shaped_rewards(exp, cfg, kl_ctl, episodes if split else None)
        if in_reward
        else last_token_rewards(
            row_outcomes(exp.scores, exp.response_mask, episodes, a.advantage_name),
            exp.response_mask,
        ),
        response_mask=exp.response_mask,
        values=exp.values,
        group_index=exp.group_index,
        episode_index=list(episodes) if split else None,
        **_estimator_kwargs(cfg),
    )
    set_kl_loss_coef(exp, cfg, kl_ctl)
    stats.update(schedule.bound_staleness(exp, step))
    stats.update(schedule.failures.metrics())

    # 5. Update: the off-policy correction weights, the critic (clipped value loss), the
    #    actor (registered policy loss), not during the critic's warmup steps; beta follows
    #    the step's KL.
    stats.update(offpolicy.correct(roles, exp, cfg, schedule.mismatch, step))
    stats.update(roles.critic.update(exp))
    warmup = step < a.critic_warmup_steps
    stats["critic_warmup"] = float(warmup)
    if not warmup:
        stats.update(roles.actor.update(exp))
    adapt_kl(exp, cfg, kl_ctl, stats)
    t1 = time.perf_counter()
    stats["time/train"] = t1 - t0

    # 6. Weight sync: the new weights reach the engine as version step + 1.
    stats.update(schedule.sync_weights(step, (t0, t1)))
    return exp, stats


StepFunction = Callable[
    [Roles, RunConfig, StepSchedule, int, KLController], tuple[Experience, dict[str, float]]
]


def step_function(cfg: RunConfig) -> StepFunction:
    """The run's step: :func:`ppo_step` for ``algo.name: ppo``, else :func:`grpo_step`."""
    return ppo_step if cfg.algo.name == "ppo" else grpo_step


def admit(
    roles: Roles,
    cfg: RunConfig,
    failures: FailureLog,
    samples: Sequence[Sample],
    scores: Tensor,
    step: int | None = None,
) -> tuple[list[Sample], Tensor, list[int]]:
    """The samples that train, their scores and the episode of each.

    Infrastructure failures are left out first (``FailureLog.admit``: out of the batch, of
    their group's statistics and of the loss normaliser; counted; budgeted). Multi-turn
    samples (``relayrl.env``) carry a loss mask: observation tokens are attended to and never
    trained (``Experience.response_mask``). An episode split at a prefix break trains each of
    its segments, each episode counted once in its group's statistics (``expand_episodes``).
    With ``train.save_trajectories`` what the step trains is written as JSONL."""
    samples, scores = failures.admit(samples, scores, grouped=cfg.algo.name != "ppo")
    samples, scores, episodes = expand_episodes(samples, scores)
    if step is not None and cfg.train.save_trajectories:
        save_trajectories(cfg.run_dir, step, samples, scores.tolist(), roles.tokenizer)
    return list(samples), scores, list(episodes)


def scored_experience(
    roles: Roles,
    cfg: RunConfig,
    samples: Sequence[Sample],
    scores: Tensor,
    episodes: Sequence[int],
    stats: dict[str, float],
) -> Experience:
    """The admitted samples packed, with their raw outcomes (``outcomes``, for the pass rate)
    and the scores that train (``scores``): ``algo.missing_eos_penalty`` taken off the rows of
    a truncated episode (:func:`missing_eos_penalty`; ``missing_eos/penalised`` in ``stats``).
    Every RL step makes its advantages from these scores. Infrastructure failures were left
    out by :func:`admit` before: they are never scored here."""
    exp = Experience.from_samples(samples, roles.tokenizer.pad_token_id)
    exp.outcomes = roles.reward.outcomes(samples, scores)  # raw verifiable outcome
    penalty = cfg.algo.missing_eos_penalty
    if penalty is None:
        exp.scores = scores
        return exp
    exp.scores, penalised = missing_eos_penalty(samples, scores, episodes, penalty)
    stats["missing_eos/penalised"] = float(penalised)
    return exp


def missing_eos_penalty(
    samples: Sequence[Sample], scores: Tensor, episodes: Sequence[int], penalty: float
) -> tuple[Tensor, int]:
    """(scores, n): s_i - penalty for each row i whose episode ended cut at the token limit
    (finish reason ``length``: its last response has no EOS or stop token; the episode's own
    sample is its last row, after its segments), s_i elsewhere; n = the episodes penalised."""
    last = {e: i for i, e in enumerate(episodes)}
    cut = {e for e, i in last.items() if samples[i].finish_reason == "length"}
    rows = torch.tensor([e in cut for e in episodes], dtype=torch.bool)
    return torch.where(rows, scores - penalty, scores), len(cut)


EPISODE_SUM_ADVANTAGES = frozenset({"grpo", "drgrpo", "rloo"})
"""The estimators that read an episode's return as its last row's sum of token rewards."""

CHAINED_ADVANTAGES = frozenset({"gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline"})
"""The estimators whose recurrence runs on across an episode's rows (``episode_index``)."""


def row_outcomes(
    scores: Tensor, response_mask: Tensor, episodes: Sequence[int], advantage: str
) -> Tensor:
    """The score each row's last valid token receives: s_i, except under an estimator of
    ``CHAINED_ADVANTAGES`` 0 on every row of a split episode but the last one with a valid
    token (rows in batch order: the episode's own sample, after its segments), the last valid
    token of the unbroken episode, so that its outcome is counted once."""
    if advantage not in CHAINED_ADVANTAGES or len(set(episodes)) == len(episodes):
        return scores
    has_tokens = (response_mask > 0).any(-1).tolist()
    last: dict[int, int] = {}
    for i, e in enumerate(episodes):
        if has_tokens[i] or e not in last:
            last[e] = i
    keep = torch.zeros(len(episodes), dtype=torch.bool)
    keep[list(last.values())] = True
    return torch.where(keep, scores, torch.zeros_like(scores))


def kl_shaped_rewards(
    exp: Experience,
    cfg: RunConfig,
    kl_ctl: KLController,
    episodes: Sequence[int] | None = None,
) -> Tensor:
    """Token rewards with the KL in the reward (``algo.kl_in: reward``): r_t = -beta *
    KL_t(pi_old || pi_ref) on every response token plus the score on the last one (beta =
    ``kl_ctl.value``, KL by ``algo.kl_kind``); sets ``exp.kl``. Their sum over a sequence,
    score - beta * sum_t KL_t, is the return a group-relative advantage normalises. With
    ``episodes`` (an episode split into several rows) and an estimator of
    ``EPISODE_SUM_ADVANTAGES``, the episode's other rows' KL goes onto its last row
    (:func:`fold_episode_kl`), so its return is score - beta * the whole episode's KL; with
    one of ``CHAINED_ADVANTAGES`` the score goes on its last row only (:func:`row_outcomes`)."""
    assert exp.scores is not None and exp.old_logprobs is not None
    assert exp.ref_logprobs is not None
    beta = kl_ctl.value
    scores = exp.scores
    if episodes is not None:
        scores = row_outcomes(scores, exp.response_mask, episodes, cfg.algo.advantage_name)
    rewards, exp.kl = apply_kl_to_rewards(
        scores,
        exp.old_logprobs,
        exp.ref_logprobs,
        exp.response_mask,
        beta,
        cfg.algo.kl_kind,
    )
    if episodes is not None and cfg.algo.advantage_name in EPISODE_SUM_ADVANTAGES:
        rewards = fold_episode_kl(rewards, exp.kl, exp.response_mask, episodes, beta)
    return rewards


def fold_episode_kl(
    rewards: Tensor, kl: Tensor, response_mask: Tensor, episodes: Sequence[int], beta: float
) -> Tensor:
    """``rewards`` with -beta * (K_e - K_r) added on the last valid token of each episode's
    last row r, K_r = sum_t KL_t of row r and K_e that sum over all rows of episode e: the
    last row's sum becomes score - beta * K_e (a last row without a valid token: unchanged)."""
    mask = response_mask > 0
    per_row = (kl * mask).sum(-1)
    ep = torch.as_tensor(list(episodes), dtype=torch.long)
    total = torch.zeros_like(per_row).index_add(0, ep, per_row)
    last_row = {e: i for i, e in enumerate(episodes)}
    out = rewards.clone()
    for e, r in last_row.items():
        valid = mask[r].nonzero()
        if len(valid):
            out[r, int(valid[-1])] -= beta * (total[e] - per_row[r])
    return out


def set_kl_loss_coef(exp: Experience, cfg: RunConfig, kl_ctl: KLController) -> None:
    """An adaptive beta of the KL loss term (``algo.kl_in: loss``) reaches the actor with the
    batch, ``exp.kl_coefs`` (the same value on every row); a fixed one is ``algo.kl_coef``."""
    a = cfg.algo
    adaptive = isinstance(kl_ctl, AdaptiveKLController)
    if adaptive and a.kl_placement == "loss" and exp.ref_logprobs is not None:
        exp.kl_coefs = torch.full((len(exp),), float(kl_ctl.value))


def adapt_kl(
    exp: Experience, cfg: RunConfig, kl_ctl: KLController, stats: dict[str, float]
) -> None:
    """beta follows the step's KL: a KL in the reward as ``algo.adaptive_kl_metric`` averages
    ``exp.kl`` (logged ``kl_in_reward``), a KL loss term as the update measured it (token mean,
    ``actor/kl``); ``kl_beta`` is beta after the update. No KL this step: nothing changes."""
    if exp.kl is not None:
        mean_kl = kl_for_controller(exp.kl, exp.response_mask, cfg.algo.adaptive_kl_metric)
        stats["kl_in_reward"] = mean_kl
    elif "actor/kl" in stats:
        mean_kl = stats["actor/kl"]
    else:
        return
    kl_ctl.update(mean_kl, len(exp))
    stats["kl_beta"] = float(kl_ctl.value)


def seed_stride(cfg: RunConfig) -> int:
    """Request seeds' step stride ``max(10_007, I * G)``: ``I`` = ``prompts_per_step`` times
    the most prompt rounds of a step (a round r's groups use index ``r * B + g``: regenerated
    groups, r <= ``failures.regenerate_rounds``; dynamic sampling's refills, r <
    ``data.dynamic_sampling.max_rounds``), so the seeds of consecutive steps never overlap;
    ``10_007`` for every batch it covers."""
    ds = cfg.data.dynamic_sampling
    rounds = max(cfg.failures.regenerate_rounds + 1, ds.max_rounds if ds.enabled else 1)
    return max(10_007, cfg.algo.prompts_per_step * rounds * cfg.algo.group_size)


def group_requests(
    prompt: TokenizedPrompt,
    cfg: RunConfig,
    step: int,
    index: int,
    group_id: int,
    stop_ids: list[int],
) -> list[GenerationRequest]:
    """The G requests of one prompt group, request k seeded
    ``(seed * 1_000_003 + step * S + index * G + k) mod 2^31`` with the step stride
    ``S = max(10_007, I * G)`` (:func:`seed_stride`): distinct for every (step, index, k) of
    a run while ``index < I``, the prompt indices a step can use."""
    r = cfg.rollout
    g_size = cfg.algo.group_size
    stride = seed_stride(cfg)
    out = []
    for k in range(g_size):
        seed = (cfg.seed * 1_000_003 + step * stride + index * g_size + k) & 0x7FFFFFFF
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
    prompts: Sequence[TokenizedPrompt],
    cfg: RunConfig,
    step: int,
    stop_ids: list[int],
    first_index: int = 0,
) -> list[GenerationRequest]:
    """G requests per prompt, one group each (group id = index of the prompt in the list),
    seeded as prompt index ``first_index + g`` of ``step`` (a refill round r: ``r * B``)."""
    return [
        req
        for g, p in enumerate(prompts)
        for req in group_requests(p, cfg, step, first_index + g, g, stop_ids)
    ]


def last_token_rewards(scores: Tensor, response_mask: Tensor) -> Tensor:
    """Outcome reward placed on each sequence's last response token: r_t = score * [t = T_i]."""
    last = (response_mask.cumsum(-1) == response_mask.sum(-1, keepdim=True)) & (response_mask > 0)
    return scores[:, None] * last.float()


def rollout_and_score(
    roles: Roles,
    requests: list[GenerationRequest],
    timer: dict[str, float],
    retries: int = 0,
    mark: Callable[[str], None] = no_mark,
) -> tuple[list[Sample], Tensor, dict[str, float]]:
    """Generate and score: one sample per request, single-turn or a whole episode (the
    rollout role is then an ``EpisodeRunner`` and the reward role an ``EpisodeScorer``:
    ``controller.schedules.attach_environments``). An infrastructure failure is generated and
    scored again up to ``retries`` times (``controller.failures``; ``failures/retried``).
    ``mark`` names each phase for a stall watchdog (``controller.watchdog``)."""
    t0 = time.perf_counter()
    mark(f"{type(roles.rollout).__name__} generating {len(requests)} requests")
    samples = roles.rollout.generate(requests)
    t1 = time.perf_counter()
    mark(f"{scorer_name(roles)} scoring {len(samples)} samples")
    scores, reward_stats = roles.reward.score(samples)
    if retries:
        samples, scores, retried = retry_failed(
            roles.rollout, roles.reward, requests, samples, scores, retries, mark
        )
        timer["failures/retried"] = timer.get("failures/retried", 0.0) + retried
    scores = renormalized(roles.reward, samples, scores)  # domain_zscore: over what trains
    timer["time/generate"] = t1 - t0
    timer["time/score"] = time.perf_counter() - t1
    return samples, scores, reward_stats


def rollout_progress(roles: Roles) -> tuple[int, int, int]:
    """(tokens the engine generated, requests it finished, samples the reward role scored):
    counters that only grow, read by a stall watchdog (``controller.watchdog``)."""
    counters = roles.rollout.report().counters
    return (
        int(counters.get("tokens_generated", 0)),
        int(counters.get("requests_finished", 0)),
        roles.reward.progress(),
    )


def scorer_name(roles: Roles) -> str:
    """What scores: ``the reward service`` or ``reward function <module.name>``."""
    if roles.reward.service is not None:
        return "the reward service"
    return f"reward function {fn_name(roles.reward.fn)}"


def distill_from_teacher(roles: Roles, exp: Experience, cfg: RunConfig) -> None:
    """On-policy distillation (``algo.distill``): the teacher scores the student's samples.

    d_t = log pi_student(y_t) - log pi_teacher(y_t), the student's logprob being the engine's
    (the distribution the token was sampled from). ``mode: reward``: A_t <- A_t - coef * d_t
    (or -coef * d_t alone without ``task_reward``); ``mode: loss``: the actor adds
    coef * agg(0.5 d_t^2) on ``exp.teacher_logprobs``. The teacher is loaded on first use.
    """
    d = cfg.algo.distill
    if roles.teacher is None:
        roles.teacher = load_teacher(cfg)
    mask = exp.response_mask
    exp.teacher_logprobs = teacher = roles.teacher.compute_logprobs(exp)
    if d.mode == "reward":
        assert exp.behaviour_logprobs is not None and exp.advantages is not None
        reverse_kl = (exp.behaviour_logprobs - teacher) * mask
        task = exp.advantages if d.task_reward else torch.zeros_like(teacher)
        exp.advantages = task - d.coef * reverse_kl


def distill_gap(exp: Experience) -> float:
    """``distill/reverse_kl``: mean over trained tokens of log pi_behav - log pi_teacher."""
    assert exp.behaviour_logprobs is not None and exp.teacher_logprobs is not None
    mask = exp.response_mask
    gap = (exp.behaviour_logprobs - exp.teacher_logprobs) * mask
    return float(gap.sum() / mask.sum().clamp(min=1))


def kl_for_controller(kl: Tensor, response_mask: Tensor, metric: str) -> float:
    """The step's KL for the adaptive controller: the mean over all valid tokens
    (``token-mean``, relayrl) or the mean over sequences of each one's token mean
    (``seq-mean``, veRL's ``mean(masked_mean(kl, mask, axis=-1))``; an empty row counts 0)."""
    mask = response_mask.to(kl.dtype)
    if metric == "seq-mean":
        per_seq = (kl * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        return float(per_seq.mean()) if len(per_seq) else 0.0
    return float((kl * mask).sum() / mask.sum().clamp(min=1))


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
    """beta of the KL to the reference (in the reward or the loss, ``algo.kl_in``): adaptive
    towards ``algo.adaptive_kl_target``, else fixed."""
    a = cfg.algo
    if a.adaptive_kl_target is not None:
        return AdaptiveKLController(a.kl_coef, a.adaptive_kl_target, a.adaptive_kl_horizon)
    return FixedKLController(a.kl_coef)


@torch.no_grad()
def rollout_stats(exp: Experience) -> dict[str, float]:
    """reward_mean, pass_rate (of the raw outcomes when recorded) and the length stats."""
    scores = exp.scores
    assert scores is not None
    outcomes = exp.outcomes if exp.outcomes is not None else scores
    return {
        "reward_mean": float(scores.mean()),
        "pass_rate": float((outcomes >= 1.0).float().mean()),
        **exp.meta(),
    }
