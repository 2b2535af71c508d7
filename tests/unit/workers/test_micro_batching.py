"""Dynamic, trimmed micro-batches and the on-policy pi_old shortcut give the same update."""

from __future__ import annotations

import copy

import pytest
import torch

from helpers import run_config
from relayrl.cluster.local import build_local_roles
from relayrl.controller.algorithms import make_requests
from relayrl.controller.offpolicy import old_logprobs
from relayrl.data.prompts import PromptSource
from relayrl.rollout.types import Sample
from relayrl.workers import ActorWorker, Experience, ReferenceWorker


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
    exp.advantages = (
        torch.arange(len(lengths), dtype=torch.float32)[:, None].expand(-1, max(lengths))
        * exp.response_mask
    )
    return exp


def test_micro_batches_trim_each_to_its_longest_response():
    exp = _exp([2, 9, 4, 1])
    parts = list(exp.micro_batches(2))
    assert [p[0].tolist() for p in parts] == [[0, 1], [2, 3]]
    assert [p[1].batch.response_ids.shape[1] for p in parts] == [9, 4]
    assert parts[1][1].advantages.shape == (2, 4)  # per-token tensors trimmed with it
    assert parts[1][1].group_index.tolist() == [2, 3]  # per-sequence tensors untouched


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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_experience_uploads_to_cuda_equal_through_pinned_memory():
    """``Experience.to(cuda)`` copies through pinned memory without blocking: the device's
    tensors equal the host's once the stream is done, and the host batch is unchanged."""
    exp = _exp([4, 2, 5])
    dev = torch.device("cuda", torch.cuda.current_device())
    on_dev = exp.to(dev)
    torch.cuda.synchronize()
    assert on_dev.batch.input_ids.device == dev and exp.batch.input_ids.device.type == "cpu"
    assert torch.equal(on_dev.batch.input_ids.cpu(), exp.batch.input_ids)
    assert torch.equal(on_dev.batch.response_mask.cpu(), exp.batch.response_mask)
    assert torch.equal(on_dev.advantages.cpu(), exp.advantages)


def test_scatter_tokens_round_trips():
    exp = _exp([2, 9, 4, 1, 6])
    parts = [(idx, micro.advantages) for idx, micro in exp.micro_batches(3, max_tokens=24)]
    torch.testing.assert_close(exp.scatter_tokens(parts), exp.advantages)


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
    exp.advantages = (
        torch.randn(exp.response_mask.shape, generator=torch.Generator().manual_seed(0))
        * exp.response_mask
    )
    assert exp.response_mask.sum(-1).min() < exp.response_mask.shape[1]  # lengths differ
    return cfg, roles, exp


def _update(cfg, model, exp, **algo) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The weights after one update, and the (clipped) gradient it stepped with."""
    a = cfg.algo.model_copy(update=algo)
    actor = ActorWorker(copy.deepcopy(model), a, cfg.optim, cfg.rollout.max_tokens, seed=0)
    actor.update(exp)
    grads = {
        k: p.grad.clone()
        for k, p in actor.model.named_parameters(remove_duplicate=False)
        if p.grad is not None
    }
    return actor.model.state_dict(), grads


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-sum-norm"])
def test_dynamic_micro_batches_give_the_same_update(batch, loss_agg):
    cfg, roles, exp = batch
    exp = copy.copy(exp)
    exp.old_logprobs = roles.actor.compute_logprobs(exp)
    common = dict(loss_agg=loss_agg, mini_batches=1)
    ref, ref_grads = _update(cfg, roles.actor.model, exp, micro_batch_size=64, **common)
    packed, grads = _update(
        cfg, roles.actor.model, exp, micro_batch_size=5, micro_batch_tokens=60, **common
    )
    # The claim is the gradient: packed micro-batches sum the same per-token terms in another
    # order (measured: <= 6e-8 apart, the largest entries 0.2).
    assert grads.keys() == ref_grads.keys()
    for k, g in ref_grads.items():
        torch.testing.assert_close(grads[k], g, atol=2e-7, rtol=1e-5)
    # The weights after Adam's first step, -lr g / (|g| + eps) with eps = 1e-8, where that step
    # is insensitive to the gradient's last bits (|g| >= 100 eps). Below, a bit of gradient
    # noise moves it by up to lr: on an Intel AVX-512 CPU one q_proj entry with g = -1.3e-9
    # landed 4.3e-6 apart, where AMD's and AVX2's kernels had stayed within 2e-6.
    for k, v in ref.items():
        g = ref_grads.get(k)
        steady = g.abs() >= 1e-6 if g is not None else torch.ones_like(v, dtype=torch.bool)
        torch.testing.assert_close(packed[k][steady], v[steady], atol=2e-6, rtol=0)


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
    fresh.old_logprobs = None
    assert (
        old_logprobs(
            roles,
            fresh,
            cfg.model_copy(update={"algo": cfg.algo.model_copy(update={"mini_batches": 1})}),
        )
        is None
    )
    recomputed = copy.copy(fresh)
    recomputed.old_logprobs = roles.actor.compute_logprobs(fresh)
    skip, _ = _update(cfg, roles.actor.model, fresh, mini_batches=1)
    full, _ = _update(cfg, roles.actor.model, recomputed, mini_batches=1)
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
    assert old_logprobs(roles, exp, naive) is exp.behaviour_logprobs
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
    adv = exp.advantages.clone()
    adv[::2] = 0.0  # half the rows carry no signal
    zeroed.advantages = adv
    nothing = copy.copy(exp)
    nothing.advantages = torch.zeros_like(adv)

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
        zero.advantages = torch.zeros_like(exp.advantages)
        assert len(actor._rows_with_gradient(zero)) == len(exp)


class _GradRecordingActor(ActorWorker):
    """The actor, keeping each optimizer step's gradients (before clipping) for comparison."""

    grads: list[dict[str, torch.Tensor]]

    def _clip_and_step(self) -> torch.Tensor:
        self.grads = getattr(self, "grads", [])
        self.grads.append(
            {n: p.grad.clone() for n, p in self.model.named_parameters() if p.grad is not None}
        )
        return super()._clip_and_step()


def _async_decoupled(tmp_path, *extra: str):
    from relayrl.config import RunConfig, load_config

    cfg = load_config(
        RunConfig,
        None,
        ["schedule=async", "algo.mini_batches=1", "algo.micro_batch_size=3", *extra],
    )
    assert cfg.policy_loss == "decoupled_ppo" and cfg.algo.epochs == 1
    return cfg


def _float64_batch(tmp_path, rows: int = 8) -> tuple[torch.nn.Module, Experience]:
    """A tiny Llama in float64 and a batch of random responses: behaviour logprobs away from
    the model's own (weights on both sides of 1, some over the cap 5), a quarter of the rows
    with zero advantages (left out of the forward)."""
    from relayrl.model import build_tiny_model, load_causal_lm

    model = load_causal_lm(build_tiny_model(tmp_path / "m", hidden_size=32), torch.float64)
    g = torch.Generator().manual_seed(3)
    samples = []
    for i in range(rows):
        p, n = 2 + i % 3, 3 + (5 * i) % 7
        samples.append(
            Sample(
                request_id=i,
                prompt_ids=torch.randint(3, 20, (p,), generator=g).tolist(),
                response_ids=torch.randint(3, 20, (n,), generator=g).tolist(),
                behaviour_logprobs=[0.0] * n,
                versions=[0] * n,
                finish_reason="eos",
                group_id=i // 2,
            )
        )
    exp = Experience.from_samples(samples, pad_id=0)
    mask = exp.response_mask
    prox = ReferenceWorker(model, 64).compute_logprobs(exp)
    exp.behaviour_logprobs = (prox + torch.randn(mask.shape, generator=g, dtype=prox.dtype)) * mask
    adv = torch.randn(mask.shape, generator=g, dtype=torch.float64) * mask
    adv[::4] = 0.0
    exp.advantages = adv
    model.requires_grad_(True)
    return model, exp


def test_decoupled_ppo_proximal_logprobs_from_the_update_forward_are_exact(tmp_path):
    """Async decoupled PPO with one update per step: pi_prox taken from the update's own
    forward (micro-batch by micro-batch, no separate forward) gives the loss, gradients,
    weights after the step and every stat (behaviour weights, capped fraction, clip fractions)
    of a separate eval-mode forward first, in float64 to 1e-12."""
    cfg = _async_decoupled(tmp_path)
    model, exp = _float64_batch(tmp_path)

    def run(with_prox: bool) -> _GradRecordingActor:
        actor = _GradRecordingActor(
            copy.deepcopy(model), cfg.algo, cfg.optim, 16, seed=0, policy_loss="decoupled_ppo"
        )
        batch = copy.copy(exp)
        if with_prox:  # the separate forward, as with mini_batches > 1
            batch.old_logprobs = actor.compute_logprobs(exp)
        actor.stats = actor.update(batch)
        return actor

    separate, reused = run(True), run(False)
    s, r = separate.stats, reused.stats
    assert s.keys() == r.keys()
    for k in s:
        assert r[k] == pytest.approx(s[k], abs=1e-12, rel=0), k
    # the behaviour weights are not trivial: some tokens capped, their mean away from 1
    assert 0 < s["actor/pg_capped_frac"] < 0.5 and abs(s["actor/pg_behav_weight_mean"] - 1) > 0.1
    assert s["actor/zero_adv_skipped_frac"] == 0.25 and s["actor/loss"] != 0.0
    (gs,), (gr,) = separate.grads, reused.grads
    assert gs.keys() == gr.keys() and len(gs) > 0
    for k in gs:
        torch.testing.assert_close(gr[k], gs[k], atol=1e-12, rtol=0)
    after = reused.model.state_dict()
    for k, v in separate.model.state_dict().items():
        torch.testing.assert_close(after[k], v, atol=1e-12, rtol=0)
    moved = [
        k
        for k, v in separate.model.state_dict().items()
        if not torch.equal(v, model.state_dict()[k])
    ]
    assert moved  # the step did move the weights


def test_a_model_with_dropout_keeps_the_separate_proximal_forward(tmp_path, monkeypatch):
    """With dropout in train mode the update's own logprobs are a dropout sample, not pi_prox:
    the actor then computes pi_prox in eval mode first, which is the separate forward's update
    (the same dropout draws: same gradients and stats), and not the shortcut's (whose ratio
    would be 1 and whose behaviour weights would be taken of the dropout sample)."""
    from relayrl.model.loading import has_train_dropout

    cfg = _async_decoupled(tmp_path)
    model, exp = _float64_batch(tmp_path)
    assert not has_train_dropout(model)
    for m in model.modules():
        if "attention_dropout" in m.__dict__:
            m.attention_dropout = 0.3  # HF attention's functional dropout
    assert has_train_dropout(model)

    def run(with_prox: bool, shortcut: bool = False) -> dict[str, torch.Tensor]:
        actor = _GradRecordingActor(
            copy.deepcopy(model), cfg.algo, cfg.optim, 16, seed=0, policy_loss="decoupled_ppo"
        )
        batch = copy.copy(exp)
        if with_prox:
            batch.old_logprobs = actor.compute_logprobs(exp)
        torch.manual_seed(11)  # the same dropout masks in every run
        if shortcut:  # what the update would do without the dropout check
            monkeypatch.setattr("relayrl.workers.actor.has_train_dropout", lambda m: False)
        stats = actor.update(batch)
        monkeypatch.undo()
        return actor.grads[0], stats

    (separate, s_stats), (auto, a_stats), (_, shortcut) = run(True), run(False), run(False, True)
    for k, v in separate.items():
        torch.testing.assert_close(auto[k], v, atol=1e-12, rtol=0)
    for k, v in s_stats.items():
        assert a_stats[k] == pytest.approx(v, abs=1e-12, rel=0), k
    # the dropout sample is not pi_prox: the ratio to the eval-mode pi_prox is not 1
    assert shortcut["actor/approx_kl"] == 0.0 and abs(s_stats["actor/approx_kl"]) > 1e-4
    assert shortcut["actor/pg_behav_weight_mean"] != pytest.approx(
        s_stats["actor/pg_behav_weight_mean"], abs=1e-6
    )
    # loading disables both kinds of dropout (modules and the functional attention dropout)
    from relayrl.model.loading import disable_dropout

    model.model.layers[0].mlp.add_module("drop", torch.nn.Dropout(0.1))
    assert has_train_dropout(disable_dropout(model)) is False
    assert all(
        m.attention_dropout == 0.0 for m in model.modules() if hasattr(m, "attention_dropout")
    )


def test_async_decoupled_step_makes_no_separate_forward_with_one_update(batch):
    """The whole step (``grpo_step``, phases 3-5) on the async schedule: with
    mini_batches = 1 the actor runs no logprob forward outside the update, with 2 it runs one
    (pi_prox before the first optimizer step)."""
    from relayrl.controller.algorithms import grpo_step, make_kl_controller
    from relayrl.controller.failures import FailureLog
    from relayrl.workers import Roles

    class Given:
        """A schedule that hands the step a given scored batch and syncs nothing."""

        mismatch = None

        def __init__(self, samples, scores, c):
            self.samples, self.scores, self.failures = samples, scores, FailureLog(c.failures)

        def rollout(self, step):
            return list(self.samples), self.scores, {}

        def bound_staleness(self, exp, step):
            return {}

        def sync_weights(self, step, trained):
            return {}

    cfg, roles, exp = batch
    scores = torch.tensor([float(i % 2) for i in range(len(exp))])
    for mini_batches, forwards in ((1, 0), (2, 1)):
        c = cfg.model_copy(
            update={
                "schedule": "async",
                "algo": cfg.algo.model_copy(update={"mini_batches": mini_batches}),
            }
        )
        actor = ActorWorker.from_config(copy.deepcopy(roles.actor.model), c)
        calls: list[int] = []
        real = actor.compute_logprobs
        actor.compute_logprobs = lambda e, real=real, calls=calls: calls.append(len(e)) or real(e)
        step_roles = Roles(actor, roles.rollout, roles.reward, roles.tokenizer)
        kl = make_kl_controller(c)
        _, stats = grpo_step(step_roles, c, Given(exp.samples, scores, c), 0, kl)
        assert len(calls) == forwards, mini_batches
        assert stats["actor/optimizer_steps"] == mini_batches
        assert "actor/pg_behav_weight_mean" in stats
