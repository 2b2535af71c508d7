"""Dynamic, trimmed micro-batches and the on-policy pi_old shortcut give the same update."""

from __future__ import annotations

import copy

import pytest
import torch

from helpers import run_config
from relayrl.cluster.local import build_local_roles
from relayrl.controller.algorithms import make_requests, old_logprobs
from relayrl.controller.prompts import PromptSource
from relayrl.rollout.types import Sample
from relayrl.workers import ActorWorker, Experience


def _exp(lengths: list[int], prompt_lengths: list[int] | None = None) -> Experience:
    prompt_lengths = prompt_lengths or [3] * len(lengths)
    samples = [
        Sample(
            request_id=i,
            prompt_ids=list(range(1, p + 1)),
            response_ids=[5] * n,
            behaviour_logprobs=[-0.5] * n,
            versions=[0] * n,
            finish_reason="eos",
            group_id=i,
        )
        for i, (p, n) in enumerate(zip(prompt_lengths, lengths, strict=True))
    ]
    exp = Experience.from_samples(samples, pad_id=0)
    exp["advantages"] = (
        torch.arange(len(lengths), dtype=torch.float32)[:, None].expand(-1, max(lengths))
        * exp.response_mask
    )
    return exp


def test_micro_batches_trim_each_to_its_longest_response():
    exp = _exp([2, 9, 4, 1])
    parts = list(exp.micro_batches(2))
    assert [p[0].tolist() for p in parts] == [[0, 1], [2, 3]]
    assert [p[1].batch.response_ids.shape[1] for p in parts] == [9, 4]
    assert parts[1][1]["advantages"].shape == (2, 4)  # per-token tensors trimmed with it
    assert parts[1][1]["group_index"].tolist() == [2, 3]  # per-sequence tensors untouched


def test_token_budget_packs_sorted_rows_under_the_budget():
    lengths = [30, 2, 7, 7, 1, 20, 3, 3]
    exp = _exp(lengths)  # prompt width P = 3
    parts = list(exp.micro_batches(max_seqs=4, max_tokens=40))
    seen = sorted(i for idx, _ in parts for i in idx.tolist())
    assert seen == list(range(len(lengths)))  # every row exactly once
    # hand-packed: [30] (33 tok), [20] (23; +7 -> 2 x 23 = 46 > 40), [7, 7, 3, 3] (4 x 10),
    # then [2, 1] (2 x 5)
    assert [sorted(lengths[i] for i in idx.tolist()) for idx, _ in parts] == [
        [30],
        [20],
        [3, 3, 7, 7],
        [1, 2],
    ]
    for _, micro in parts:
        width = micro.batch.input_ids.shape[1]
        assert len(micro) * width <= 40 or len(micro) == 1


def test_scatter_tokens_round_trips():
    exp = _exp([2, 9, 4, 1, 6])
    parts = [(idx, micro["advantages"]) for idx, micro in exp.micro_batches(3, max_tokens=24)]
    torch.testing.assert_close(exp.scatter_tokens(parts), exp["advantages"])


@pytest.fixture(scope="module")
def batch(sft_model, tmp_path_factory):
    cfg = run_config(
        sft_model,
        tmp_path_factory.mktemp("mb"),
        "algo.prompts_per_step=4",
        "algo.group_size=4",
        "rollout.max_tokens=12",
    )
    roles = build_local_roles(cfg, str(sft_model), None)
    prompts = PromptSource(cfg.data, roles.tokenizer, 0).for_step(0, 4)
    samples = roles.rollout.generate(make_requests(prompts, cfg, 0, [roles.tokenizer.eos_token_id]))
    exp = Experience.from_samples(samples, roles.tokenizer.pad_token_id)
    exp["advantages"] = (
        torch.randn(exp.response_mask.shape, generator=torch.Generator().manual_seed(0))
        * exp.response_mask
    )
    assert exp.response_mask.sum(-1).min() < exp.response_mask.shape[1]  # lengths differ
    return cfg, roles, exp


def _update(cfg, model, exp, **algo) -> dict[str, torch.Tensor]:
    a = cfg.algo.model_copy(update=algo)
    actor = ActorWorker(copy.deepcopy(model), a, cfg.optim, cfg.rollout.max_tokens, seed=0)
    actor.update(exp)
    return actor.model.state_dict()


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-sum-norm"])
def test_dynamic_micro_batches_give_the_same_update(batch, loss_agg):
    cfg, roles, exp = batch
    exp = copy.copy(exp)
    exp.tensors = dict(exp.tensors, old_logprobs=roles.actor.compute_logprobs(exp))
    common = dict(loss_agg=loss_agg, mini_batches=1)
    ref = _update(cfg, roles.actor.model, exp, micro_batch_size=64, **common)
    packed = _update(
        cfg, roles.actor.model, exp, micro_batch_size=5, micro_batch_tokens=60, **common
    )
    for k, v in ref.items():
        torch.testing.assert_close(packed[k], v, atol=2e-6, rtol=0)


def test_logprobs_with_dynamic_micro_batches_match(batch):
    cfg, roles, exp = batch
    full = roles.actor.compute_logprobs(exp)
    roles.actor.micro_batch_tokens, saved = 40, roles.actor.micro_batch_tokens
    try:
        packed = roles.actor.compute_logprobs(exp)
    finally:
        roles.actor.micro_batch_tokens = saved
    torch.testing.assert_close(packed, full, atol=1e-5, rtol=0)


def test_single_update_without_recompute_is_the_same_update(batch):
    """One update per step: pi_old = the update's own detached logprobs == a recompute."""
    cfg, roles, exp = batch
    fresh = copy.copy(exp)
    fresh.tensors = {k: v for k, v in exp.tensors.items() if k != "old_logprobs"}
    assert (
        old_logprobs(
            roles,
            fresh,
            cfg.model_copy(update={"algo": cfg.algo.model_copy(update={"mini_batches": 1})}),
        )
        is None
    )
    recomputed = copy.copy(fresh)
    recomputed.tensors = dict(fresh.tensors, old_logprobs=roles.actor.compute_logprobs(fresh))
    skip = _update(cfg, roles.actor.model, fresh, mini_batches=1)
    full = _update(cfg, roles.actor.model, recomputed, mini_batches=1)
    for k, v in full.items():
        torch.testing.assert_close(skip[k], v, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="old_logprobs missing"):
        _update(cfg, roles.actor.model, fresh, mini_batches=2)


def test_naive_ppo_off_policy_uses_the_behaviour_policy(batch):
    """AReaL's naive baseline: in async, plain PPO clips around the behaviour logprobs."""
    cfg, roles, exp = batch
    naive = cfg.model_copy(
        update={"schedule": "async", "algo": cfg.algo.model_copy(update={"policy_loss": "ppo"})}
    )
    assert old_logprobs(roles, exp, naive) is exp["behaviour_logprobs"]
    decoupled = cfg.model_copy(update={"schedule": "async"})
    assert decoupled.policy_loss == "decoupled_ppo"
    prox = old_logprobs(roles, exp, decoupled)  # default mini_batches=2: recomputed
    torch.testing.assert_close(prox, roles.actor.compute_logprobs(exp))


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-sum-norm"])
def test_skipping_zero_advantage_rows_gives_the_same_update(batch, loss_agg):
    """GRPO groups that all scored the same have A = 0 on every token: leaving them out of the
    forward/backward (the normaliser still counts them) changes nothing, also when a whole
    step is skipped after a real one (Adam's moments still move on the zero gradient)."""
    cfg, roles, exp = batch
    zeroed = copy.copy(exp)
    adv = exp["advantages"].clone()
    adv[::2] = 0.0  # half the rows carry no signal
    zeroed.tensors = dict(exp.tensors, advantages=adv)
    nothing = copy.copy(exp)
    nothing.tensors = dict(exp.tensors, advantages=torch.zeros_like(adv))

    def two_steps(skip: bool) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        a = cfg.algo.model_copy(
            update=dict(loss_agg=loss_agg, mini_batches=1, skip_zero_advantage=skip)
        )
        actor = ActorWorker(copy.deepcopy(roles.actor.model), a, cfg.optim, 12, seed=0)
        stats = actor.update(zeroed)
        actor.update(nothing)
        return actor.model.state_dict(), stats

    (full, full_stats), (skip, skip_stats) = two_steps(False), two_steps(True)
    assert full_stats["actor/zero_adv_skipped_frac"] == 0.0
    assert skip_stats["actor/zero_adv_skipped_frac"] == pytest.approx(0.5, abs=0.07)
    assert skip_stats["actor/grad_norm"] == pytest.approx(full_stats["actor/grad_norm"], rel=1e-5)
    for k, v in full.items():
        torch.testing.assert_close(skip[k], v, atol=1e-6, rtol=0)


def test_zero_advantage_rows_are_trained_when_the_loss_has_other_terms(batch):
    cfg, roles, exp = batch
    for update in ({"entropy_coef": 0.01}, {"kl_coef": 0.1}):
        a = cfg.algo.model_copy(update=update)
        actor = ActorWorker(copy.deepcopy(roles.actor.model), a, cfg.optim, 12, seed=0)
        zero = copy.copy(exp)
        zero.tensors = dict(exp.tensors, advantages=torch.zeros_like(exp["advantages"]))
        assert len(actor._rows_with_gradient(zero)) == len(exp)
