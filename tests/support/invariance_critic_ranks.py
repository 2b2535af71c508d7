"""Rank code of the critic and LoRA cases of the world-size invariance tests (importable by
spawned children): the critic's options (value clipping active, every loss aggregation, an
empty row under ``seq_mean_empty_rows: skip``, dynamic micro-batches) and a LoRA actor, with
several mini-batches per step (``invariance_ranks.MINI``, ``MICRO``), on FSDP2 and replicated
data-parallel ranks (world 0: one process), with their update statistics.

A case's result is (full weights, statistics of each step) as ``invariance_loss_ranks``'s, so
``invariance_loss_ranks.assert_ranks_equal_one_process`` compares it; the critic's statistics
carry the values it computed for the rank's rows (``values``, compared on rank 0's rows) and a
LoRA case's weights are the merged ones, its adapters (the peft state) a third item.
"""

from __future__ import annotations

from pathlib import Path

import torch

from fsdp_ranks import critic_experience, shard
from helpers import join_gloo, leave_process_group
from invariance_loss_ranks import assert_ranks_equal_one_process
from invariance_ranks import MICRO, MINI
from scale_helpers import random_experience, scale_config

CLIP = "algo.vf_clip=0.01"
"""Old values 0.1 * N(0, 1) against a value head near 0: with the default 0.2 nothing clips."""
CRITIC_CASES: dict[str, tuple[str, ...]] = {
    "critic_clipped": (CLIP,),
    "critic_seq_mean_token_sum": (CLIP, "algo.loss_agg=seq-mean-token-sum"),
    "critic_seq_mean_token_mean": (CLIP, "algo.loss_agg=seq-mean-token-mean"),
    "critic_seq_mean_token_sum_norm": (CLIP, "algo.loss_agg=seq-mean-token-sum-norm"),
    "critic_token_sum": (CLIP, "algo.loss_agg=token-sum"),
    "critic_empty_row_dynamic": (
        CLIP,
        "algo.loss_agg=seq-mean-token-mean",
        "algo.seq_mean_empty_rows=skip",
        "algo.micro_batch_tokens=12",
    ),
}
QUICK_CRITIC = ("critic_clipped", "critic_empty_row_dynamic")
"""The critic cases of the default test run (on the ranks of test_world_size_invariance.py)."""
EMPTY_ROW = 6
"""The row (rank 1's) whose response mask is all 0 in ``critic_empty_row_dynamic``."""
LORA = ("model.lora.r=4", "model.lora.alpha=8", "model.lora.dropout=0.0")


def critic_batch(model_dir: Path, case: str) -> object:
    """``critic_experience`` (random returns, old values 0.1 * N(0, 1)); ``*_empty_row*``:
    row ``EMPTY_ROW`` without response tokens."""
    exp = critic_experience(model_dir)
    if "empty_row" in case:
        exp.batch.response_mask[EMPTY_ROW] = 0.0
        for name in ("returns", "values"):
            setattr(exp, name, getattr(exp, name) * exp.response_mask.to(torch.float64))
    return exp


def critic_run(model_dir: Path, rank: int, world: int, case: str, fsdp: bool) -> tuple[dict, list]:
    """(full weights, statistics and ``values`` of each step) after 2 critic steps (values of
    the rank's rows, then the update) on this rank's shard; world 0: one process, all rows."""
    from relayrl.workers.build import build_critic

    opts = (*MINI, *MICRO, "algo.name=ppo", *CRITIC_CASES[case])
    opts += ("model.fsdp.enabled=true",) * fsdp
    critic = build_critic(scale_config(model_dir, *opts), str(model_dir), rank, max(world, 1))
    stats = []
    for _ in range(2):
        exp = shard(critic_batch(model_dir, case), rank, world or 1)
        values = critic.compute_values(exp)
        stats.append({**critic.update(exp), "values": values})
    return critic.parallelism.full_state_dict(critic.model), stats


def lora_run(model_dir: Path, rank: int, world: int, fsdp: bool) -> tuple[dict, list, dict]:
    """(merged weights, statistics of each step, adapters) after 2 LoRA actor steps with 3
    mini-batches on this rank's shard, pi_old = pi_theta + 0.3 * N(0, 1) per token (drawn on
    the whole batch: the clip acts); ranks draw different initial adapters (rank 0's are
    broadcast)."""
    from relayrl.workers.build import build_actor

    opts = (*MINI, *MICRO, *LORA, *(["model.fsdp.enabled=true"] * fsdp))
    torch.manual_seed(rank + 7)
    actor = build_actor(scale_config(model_dir, *opts), str(model_dir), rank, max(world, 1))
    stats = []
    for step in range(2):
        exp = random_experience(model_dir, seed=step, dtype=torch.float64)
        g = torch.Generator().manual_seed(100 + step)
        mask = exp.response_mask.to(torch.float64)
        exp.old_logprobs = 0.3 * torch.randn(mask.shape, generator=g, dtype=torch.float64) * mask
        exp = shard(exp, rank, world or 1)
        assert exp.old_logprobs is not None
        exp.old_logprobs = actor.compute_logprobs(exp) + exp.old_logprobs
        stats.append(actor.update(exp))
    return actor.state_dict(), stats, actor.adapter_state()


def run_cases(model_dir: Path, rank: int, world: int, cases: tuple[str, ...]) -> dict:
    """(case, fsdp) -> ``critic_run`` for each case of ``cases`` (``lora``: ``lora_run``), on
    FSDP2 and replicated ranks (weights on rank 0 only under FSDP2)."""
    out: dict = {}
    for fsdp in (True, False):
        for case in cases:
            if case == "lora":
                out[(case, fsdp)] = lora_run(model_dir, rank, world, fsdp)
            else:
                out[(case, fsdp)] = critic_run(model_dir, rank, world, case, fsdp)
    return out


def assert_critic_equal_one_process(
    ranks: list[dict], one: tuple[dict, list], case: str, fsdp: bool, tol: float = 1e-9
) -> None:
    """The ranks' ``critic_run`` of ``case`` (``ranks``: their ``run_cases``) against one
    process's: weights and every statistic (``assert_ranks_equal_one_process``), and each
    rank's values those of its rows (rank 0: rows 0-4, rank 1: rows 5-7)."""
    weights, stats = one
    rows = [slice(0, 5), slice(5, None)]
    plain = []
    for r, got in enumerate(ranks):
        w, steps = got[(case, fsdp)]
        for step, s in enumerate(steps):
            diff = float((s["values"] - stats[step]["values"][rows[r]]).abs().max())
            assert diff < tol, (r, step, diff)
        plain.append({(case, fsdp): (w, [_no_values(s) for s in steps])})
    want = (weights, [_no_values(s) for s in stats])
    assert_ranks_equal_one_process(plain, want, case, fsdp, tol)


def _no_values(stats: dict) -> dict:
    return {k: v for k, v in stats.items() if k != "values"}


def rank_main(
    rank: int, world: int, init_file: str, model_dir: str, out_dir: str, cases: tuple[str, ...]
) -> None:
    """``run_cases``; rank r's results to ``out_dir/critic_rank{r}.pt``."""
    join_gloo(rank, world, init_file)
    out = run_cases(Path(model_dir), rank, world, cases)
    torch.save(out, Path(out_dir) / f"critic_rank{rank}.pt")
    leave_process_group()
