"""Rank code of the loss cases of the world-size invariance tests (importable by spawned
children): the actor trained by every registered policy loss and the other per-token terms a
user can configure (GRPO's KL loss against pi_ref, the entropy bonus, the distillation loss,
rollout-correction weights, behaviour logprobs unlike pi_old, pi_old unlike pi_theta so the
clips are active, zero-advantage rows, an empty row, dynamic micro-batches, one update per step
with pi_old from the update's own forward), on FSDP2 and replicated data-parallel ranks (world
0: one process), with its update statistics.

The batch's off-policy inputs are built on the WHOLE batch before it is sharded, as the
controller builds them: pi_old = pi_theta + d_old, pi_behav = pi_old + d_behav, pi_ref =
pi_old + d_ref, pi_teacher = pi_old + d_teacher with fixed random d_* per token, and the
rollout weights of ``rollout_correction`` (log rho = trainer - engine = -d_behav) on the whole
batch.
"""

from __future__ import annotations

from pathlib import Path

import torch

from fsdp_ranks import shard
from helpers import join_gloo, leave_process_group
from invariance_ranks import MICRO, MINI
from scale_helpers import random_experience, scale_config

# name -> config overrides (the batch's extras are chosen by the names under ``_extras``)
CASES: dict[str, tuple[str, ...]] = {
    "ppo_dual_clip": ("algo.policy_loss=ppo", "algo.dual_clip=1.2", "algo.clip_eps_high=0.1"),
    "decoupled_ppo": ("algo.policy_loss=decoupled_ppo", "algo.behav_weight_cap=1.1"),
    "decoupled_ppo_seq_clamp": (
        "algo.policy_loss=decoupled_ppo",
        "algo.behav_weight_mode=sequence-clamp",
        "algo.behav_weight_cap=1.05",
    ),
    "decoupled_ppo_tis": (
        "algo.policy_loss=decoupled_ppo",
        "algo.rollout_correction.mode=tis",
        "algo.rollout_correction.cap=1.1",
    ),
    "gspo": (
        "algo.policy_loss=gspo",
        "algo.loss_agg=seq-mean-token-mean",
        "algo.clip_eps_low=0.01",
        "algo.clip_eps_high=0.01",
    ),
    "gspo_token": ("algo.policy_loss=gspo_token", "algo.clip_eps_low=0.01"),
    "cispo": ("algo.policy_loss=cispo", "algo.clip_eps_high=0.05"),
    "sapo": ("algo.policy_loss=sapo", "algo.loss_agg=seq-mean-token-sum"),
    "gmpo_mis": (
        "algo.policy_loss=gmpo",
        "algo.loss_agg=seq-mean-token-mean",
        "algo.rollout_correction.mode=mis",
        "algo.rollout_correction.upper=1.2",
    ),
    "grpo_kl_entropy": (
        "algo.kl_coef=0.3",
        "algo.kl_estimator=k2",
        "algo.entropy_coef=0.05",
        "algo.loss_agg=seq-mean-token-sum-norm",
    ),
    "entropy_only": ("algo.entropy_coef=-0.02",),
    "skip_empty_row": (
        "algo.loss_agg=seq-mean-token-mean",
        "algo.seq_mean_empty_rows=skip",
        "algo.policy_loss=cispo",
    ),
    "no_skip_zero_adv": ("algo.skip_zero_advantage=false", "algo.loss_agg=token-sum"),
    "tis_batch_norm_seq": (
        "algo.rollout_correction.mode=tis",
        "algo.rollout_correction.level=sequence",
        "algo.rollout_correction.batch_normalize=true",
        "algo.rollout_correction.cap=3.0",
    ),
    "distill_loss": (
        "algo.distill.teacher_path=teacher",  # only its logprobs are read here
        "algo.distill.mode=loss",
        "algo.distill.coef=0.5",
        "algo.loss_agg=seq-mean-token-mean",
    ),
    "dynamic_micro": ("algo.micro_batch_tokens=12", "algo.policy_loss=gspo_token"),
    "single_update_decoupled": (
        "algo.mini_batches=1",
        "algo.epochs=1",
        "algo.policy_loss=decoupled_ppo",
        "algo.behav_weight_cap=1.1",
    ),
}
SINGLE = "single_update_decoupled"
"""The case whose batch has no old_logprobs: pi_old (decoupled PPO's pi_prox) is the update's
own forward (one update per step), pi_behav and pi_ref are taken around pi_theta."""
QUICK = ("decoupled_ppo", "gspo", "grpo_kl_entropy", "skip_empty_row")
"""The cases of the default test run, on the ranks of test_world_size_invariance.py (the others
are marked ``slow``, on their own ranks)."""
EMPTY_ROW = 6
"""The row whose response mask is all 0 in the ``skip_empty_row`` case (a multi-turn episode
whose every token is an observation): rank 1's, and counted by ``seq_mean_empty_rows``."""


def full_batch(model_dir: Path, case: str, seed: int):
    """The step's whole batch: ``random_experience`` (rows 0 and 4 with advantage 0) with
    d_old, d_behav, d_ref in ``old_logprobs`` / ``behaviour_logprobs`` / ``ref_logprobs``
    (added to pi_theta on the rank) and the whole batch's rollout weights."""
    from relayrl.algos import rollout_correction
    from relayrl.config.algo import RolloutCorrectionConfig

    exp = random_experience(model_dir, seed=seed, dtype=torch.float64)
    if case == "skip_empty_row":
        exp.batch.response_mask[EMPTY_ROW] = 0.0
        assert exp.advantages is not None
        exp.advantages = exp.advantages * exp.response_mask.to(torch.float64)
    mask = exp.response_mask.to(torch.float64)
    g = torch.Generator().manual_seed(100 + seed)
    exp.old_logprobs = 0.3 * torch.randn(mask.shape, generator=g, dtype=torch.float64) * mask
    exp.behaviour_logprobs = 0.2 * torch.randn(mask.shape, generator=g, dtype=torch.float64) * mask
    exp.ref_logprobs = 0.5 * torch.randn(mask.shape, generator=g, dtype=torch.float64) * mask
    exp.teacher_logprobs = 0.4 * torch.randn(mask.shape, generator=g, dtype=torch.float64) * mask
    overrides = dict(o.split("=", 1) for o in CASES[case])
    prefix = "algo.rollout_correction."
    rc_opts = {k[len(prefix) :]: v for k, v in overrides.items() if k.startswith(prefix)}
    if rc_opts:
        rc = RolloutCorrectionConfig.model_validate(rc_opts)
        weights, _ = rollout_correction(
            torch.zeros_like(mask),  # log rho = trainer - engine = -d_behav
            exp.behaviour_logprobs,
            exp.response_mask,
            mode=rc.mode,
            level=rc.level,
            cap=rc.cap,
            lower=rc.lower,
            upper=rc.upper,
            batch_normalize=rc.batch_normalize,
        )
        assert bool((weights[mask.bool()] != 1).any())  # the weights do something
        exp.rollout_weights = weights
    return exp


def actor_run(model_dir: Path, rank: int, world: int, case: str, fsdp: bool) -> tuple[dict, list]:
    """(weights, statistics of each update) after 2 steps of this rank's shard; world 0: one
    process, all rows."""
    from relayrl.workers.build import build_actor

    opts = (*MINI, *MICRO, *CASES[case], *(["model.fsdp.enabled=true"] * fsdp))
    actor = build_actor(scale_config(model_dir, *opts), str(model_dir), rank, max(world, 1))
    stats = []
    for step in range(2):
        exp = shard(full_batch(model_dir, case, step), rank, world or 1)
        theta = actor.compute_logprobs(exp)
        assert exp.old_logprobs is not None and exp.behaviour_logprobs is not None
        assert exp.ref_logprobs is not None and exp.teacher_logprobs is not None
        old = theta if case == SINGLE else theta + exp.old_logprobs
        exp.old_logprobs = None if case == SINGLE else old
        exp.behaviour_logprobs = old + exp.behaviour_logprobs
        exp.ref_logprobs = old + exp.ref_logprobs
        exp.teacher_logprobs = old + exp.teacher_logprobs
        stats.append(actor.update(exp))
    return actor.state_dict(), stats


_NOT_GLOBAL = {"actor/loss", "critic/vf_loss"}
"""A rank's partial loss (normalised by the global counts): the ranks' add up to the loss (the
worker group's ``SUMMED_STATS``)."""


def max_diff(a: dict, b: dict) -> float:
    """The largest |a - b| over the tensors of two state dicts with the same keys."""
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def stat_diffs(ranks: list[list[dict]], one: list[dict]) -> dict[str, float]:
    """|rank statistic - one process's| per key and step, the worst rank (the loss: |the
    ranks' sum - one process's|); every rank must return one process's keys."""
    diffs = {}
    for step, want in enumerate(one):
        for r, got in enumerate(ranks):
            assert got[step].keys() == want.keys(), (r, step)
        for k, v in want.items():
            if k in _NOT_GLOBAL:
                diffs[f"{k}@{step}"] = abs(sum(got[step][k] for got in ranks) - v)
            else:
                diffs[f"{k}@{step}"] = max(abs(got[step][k] - v) for got in ranks)
    return diffs


def assert_ranks_equal_one_process(
    ranks: list[dict], one: tuple[dict, list], case: str, fsdp: bool, tol: float = 1e-9
) -> None:
    """Rank 0's weights and every rank's statistics (``ranks``: the ranks' ``run_cases``)
    equal one process's ``actor_run`` of ``case`` within ``tol``."""
    weights, stats = one
    assert max_diff(ranks[0][(case, fsdp)][0], weights) < tol
    diffs = stat_diffs([r[(case, fsdp)][1] for r in ranks], stats)
    assert {k: d for k, d in diffs.items() if not d < tol} == {}


def run_cases(model_dir: Path, rank: int, world: int, cases: tuple[str, ...]) -> dict:
    """(case, fsdp) -> ``actor_run`` for every case of ``cases``, on FSDP2 and replicated
    ranks (weights on rank 0 only under FSDP2)."""
    return {
        (case, fsdp): actor_run(model_dir, rank, world, case, fsdp)
        for fsdp in (True, False)
        for case in cases
    }


def rank_main(
    rank: int, world: int, init_file: str, model_dir: str, out_dir: str, cases: tuple[str, ...]
) -> None:
    """``run_cases``; rank r's results to ``out_dir/losses_rank{r}.pt``."""
    join_gloo(rank, world, init_file)
    out = run_cases(Path(model_dir), rank, world, cases)
    torch.save(out, Path(out_dir) / f"losses_rank{rank}.pt")
    leave_process_group()
