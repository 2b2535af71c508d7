"""Request seeds: ``(seed * 1_000_003 + step * S + index * G + k) mod 2^31`` with the step
stride ``S = max(10_007, B * (regenerate_rounds + 1) * G)``: by hand for a small batch (the
stride every batch up to 10_007 indices x samples keeps), and distinct over consecutive steps
for a batch past it (before, step s + 1's first requests repeated step s's later seeds)."""

from __future__ import annotations

from relayrl.config import RunConfig, load_config
from relayrl.controller.algorithms import group_requests, make_requests, seed_stride
from relayrl.data.prompts import TokenizedPrompt
from relayrl.data.records import PromptRecord


def _cfg(*overrides: str) -> RunConfig:
    return load_config(RunConfig, None, ["model.path=/nonexistent", "threads=1", *overrides])


def _seeds(cfg: RunConfig, step: int, index: int) -> list[int]:
    prompt = TokenizedPrompt(PromptRecord("1 + 1", "2"), [1, 2])
    return [r.params.seed for r in group_requests(prompt, cfg, step, index, index, [])]


def test_small_batch_seeds_by_hand():
    cfg = _cfg("seed=3", "algo.prompts_per_step=2", "algo.group_size=2")
    assert seed_stride(cfg) == 10_007  # 2 x (2 + 1) x 2 = 12 < 10_007
    # 3 * 1_000_003 + 1 * 10_007 + 1 * 2 + k
    assert _seeds(cfg, step=1, index=1) == [3_010_018, 3_010_019]


def test_seeds_of_consecutive_steps_are_distinct_past_the_small_stride():
    cfg = _cfg("algo.prompts_per_step=1024", "algo.group_size=4", "failures.regenerate_rounds=2")
    stride = seed_stride(cfg)
    assert stride == 1024 * 3 * 4  # 12_288 > 10_007
    indices = range(1024 * 3)  # round r's regenerated group g: index r * B + g
    seeds = [s for step in range(3) for i in indices for s in _seeds(cfg, step, i)]
    assert len(set(seeds)) == len(seeds) == 3 * 1024 * 3 * 4


def test_dynamic_sampling_refill_rounds_are_seeded_apart_from_round_0():
    cfg = _cfg(
        "algo.prompts_per_step=600",
        "algo.group_size=8",
        "failures.regenerate_rounds=0",
        "data.dynamic_sampling.enabled=true",
        "data.dynamic_sampling.max_rounds=3",
    )
    assert seed_stride(cfg) == 600 * 3 * 8  # 14_400: the refill rounds counted
    prompts = [TokenizedPrompt(PromptRecord(f"{i} + 1", None), [1, i]) for i in range(600)]
    rounds = [make_requests(prompts, cfg, step, [], r * 600) for step in (4, 5) for r in range(3)]
    seeds = [req.params.seed for reqs in rounds for req in reqs]
    assert len(set(seeds)) == len(seeds) == 2 * 3 * 600 * 8
    assert [req.group_id for req in rounds[1]][::8] == list(range(600))  # ids stay 0..n-1
