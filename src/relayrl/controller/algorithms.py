"""The RL algorithms as short programs over roles, one training step each.

Read top to bottom like the papers' pseudo-code:
GRPO (DeepSeekMath, Shao et al. 2024) and PPO-RLHF (InstructGPT, Ouyang et al. 2022).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import Tensor

from relayrl.algos import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_to_rewards,
    compute_advantages,
)
from relayrl.config import RunConfig
from relayrl.controller.prompts import TokenizedPrompt
from relayrl.rollout import GenerationRequest, Sample, SamplingParams
from relayrl.workers import Experience, Roles

KLController = FixedKLController | AdaptiveKLController


def make_requests(
    prompts: Sequence[TokenizedPrompt], cfg: RunConfig, step: int, stop_ids: list[int]
) -> list[GenerationRequest]:
    """G requests per prompt, one group each; every request seeded from (run seed, step, index)."""
    r = cfg.rollout
    reqs = []
    for g, p in enumerate(prompts):
        for k in range(cfg.algo.group_size):
            seed = (cfg.seed * 1_000_003 + step * 10_007 + g * cfg.algo.group_size + k) & 0x7FFFFFFF
            params = SamplingParams(
                temperature=r.temperature,
                top_p=r.top_p,
                top_k=r.top_k,
                max_tokens=r.max_tokens,
                stop_token_ids=stop_ids,
                seed=seed,
            )
            reqs.append(GenerationRequest(p.ids, params, group_id=g, metadata=p.fields()))
    return reqs


def last_token_rewards(scores: Tensor, response_mask: Tensor) -> Tensor:
    """Outcome reward placed on each sequence's last response token: r_t = score * [t = T_i]."""
    last = (response_mask.cumsum(-1) == response_mask.sum(-1, keepdim=True)) & (response_mask > 0)
    return scores[:, None] * last.float()


def rollout_and_score(
    roles: Roles, requests: list[GenerationRequest], timer: dict[str, float]
) -> tuple[list[Sample], Tensor, dict[str, float]]:
    t0 = time.perf_counter()
    samples = roles.rollout.generate(requests)
    t1 = time.perf_counter()
    scores, reward_stats = roles.reward.score(samples)
    timer["time/generate"] = t1 - t0
    timer["time/score"] = time.perf_counter() - t1
    return samples, scores, reward_stats


def grpo_step(
    roles: Roles, prompts: Sequence[TokenizedPrompt], cfg: RunConfig, step: int, stop_ids: list[int]
) -> tuple[Experience, dict[str, float]]:
    """GRPO: sample G answers per prompt, score them, advantage = group-normalised score,
    PPO-clip update with KL(pi || pi_ref) as a k3 loss term."""
    a = cfg.algo
    timer: dict[str, float] = {}
    samples, scores, stats = rollout_and_score(
        roles, make_requests(prompts, cfg, step, stop_ids), timer
    )

    t0 = time.perf_counter()
    exp = Experience.from_samples(samples, roles.tokenizer.pad_token_id)
    exp["scores"] = scores
    exp["old_logprobs"] = roles.actor.compute_logprobs(exp)
    if a.kl_coef > 0 and roles.reference is not None:
        exp["ref_logprobs"] = roles.reference.compute_logprobs(exp)
    exp["advantages"], _ = compute_advantages(
        a.advantage_name,
        token_rewards=last_token_rewards(scores, exp.response_mask),
        response_mask=exp.response_mask,
        group_index=exp["group_index"],
        **_estimator_kwargs(cfg),
    )
    stats.update(roles.actor.update(exp))
    timer["time/train"] = time.perf_counter() - t0
    stats.update(timer)
    return exp, stats


def ppo_step(
    roles: Roles,
    prompts: Sequence[TokenizedPrompt],
    cfg: RunConfig,
    step: int,
    stop_ids: list[int],
    kl_ctl: KLController,
) -> tuple[Experience, dict[str, float]]:
    """PPO-RLHF: r_t = -beta * KL_t (+ score on the last token), GAE with the critic's values,
    clipped value loss for the critic, PPO-clip for the actor; beta fixed or adaptive."""
    a = cfg.algo
    assert roles.critic is not None and roles.reference is not None, (
        "PPO needs critic and reference"
    )
    timer: dict[str, float] = {}
    samples, scores, stats = rollout_and_score(
        roles, make_requests(prompts, cfg, step, stop_ids), timer
    )

    t0 = time.perf_counter()
    exp = Experience.from_samples(samples, roles.tokenizer.pad_token_id)
    exp["scores"] = scores
    exp["old_logprobs"] = roles.actor.compute_logprobs(exp)
    exp["ref_logprobs"] = roles.reference.compute_logprobs(exp)
    exp["values"] = roles.critic.compute_values(exp)
    token_rewards, kl = apply_kl_to_rewards(
        scores, exp["old_logprobs"], exp["ref_logprobs"], exp.response_mask, kl_ctl.value, a.kl_kind
    )
    exp["advantages"], exp["returns"] = compute_advantages(
        a.advantage_name,
        token_rewards=token_rewards,
        response_mask=exp.response_mask,
        values=exp["values"],
        group_index=exp["group_index"],
        **_estimator_kwargs(cfg),
    )
    stats.update(roles.critic.update(exp))
    stats.update(roles.actor.update(exp))
    mean_kl = float((kl * exp.response_mask).sum() / exp.response_mask.sum().clamp(min=1))
    kl_ctl.update(mean_kl, len(exp))
    stats["kl_in_reward"] = mean_kl
    stats["kl_beta"] = float(kl_ctl.value)
    timer["time/train"] = time.perf_counter() - t0
    stats.update(timer)
    return exp, stats


def _estimator_kwargs(cfg: RunConfig) -> dict[str, float | bool]:
    a = cfg.algo
    name = a.advantage_name
    if name == "gae":
        return {"gamma": a.gamma, "lam": a.lam, "whiten": a.whiten_advantages}
    if name == "grpo":
        return {"norm_by_std": a.norm_by_std}
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
    return {
        "reward_mean": float(scores.mean()),
        "pass_rate": float((scores >= 1.0).float().mean()),
        **exp.meta(),
    }
