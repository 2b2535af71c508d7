"""The points where relayrl's convention differs from veRL's, each with veRL's as an option:
singleton groups, the REINFORCE++-baseline target, the KL fed to the adaptive controller and
the seq-mean denominator with empty rows (values checked against veRL's formulas)."""

from types import SimpleNamespace

import pytest
import torch

from helpers import leave_process_group
from relayrl.algos import (
    LossNorm,
    aggregate_loss,
    compute_drgrpo,
    compute_grpo,
    compute_reinforce_plus_plus_baseline,
    masked_whiten,
)
from relayrl.config import RunConfig, load_config
from relayrl.controller.algorithms import _estimator_kwargs, kl_for_controller
from relayrl.workers.actor import ActorWorker
from relayrl.workers.critic import CriticWorker

D = torch.float64


def _outcome(scores: list[float], lengths: list[int], t: int = 3) -> tuple[torch.Tensor, ...]:
    mask = torch.arange(t) < torch.tensor(lengths)[:, None]
    rewards = torch.zeros(len(scores), t, dtype=D)
    for i, (s, n) in enumerate(zip(scores, lengths, strict=True)):
        rewards[i, n - 1] = s
    return rewards, mask


def test_singleton_group_zero_or_raw_score() -> None:
    # groups: {0, 1} with scores 1, 0 and the singleton {2} with score 0.5
    rewards, mask = _outcome([1.0, 0.0, 0.5], [2, 3, 1])
    group = torch.tensor([0, 0, 1])
    ours, _ = compute_grpo(rewards, mask, group)
    verl, _ = compute_grpo(rewards, mask, group, singleton="score")
    std = torch.tensor([1.0, 0.0]).std().item()  # unbiased: 0.7071
    assert ours[2, 0].item() == 0.0
    assert verl[2, 0].item() == pytest.approx(0.5 / (1 + 1e-6))  # (0.5 - 0) / (1 + eps)
    torch.testing.assert_close(ours[:2], verl[:2])
    assert ours[0, 0].item() == pytest.approx(0.5 / (std + 1e-6))
    dr, _ = compute_drgrpo(rewards, mask, group, singleton="score")
    assert dr[2, 0].item() == 0.5 and dr[0, 0].item() == 0.5
    with pytest.raises(ValueError) as err:
        compute_grpo(rewards, mask, group, singleton="nan")
    assert str(err.value) == "unknown singleton convention 'nan'; known: ['zero', 'score']"


def test_reinforce_pp_baseline_targets() -> None:
    # two groups of two, gamma 0.5, score on the last token: return-to-go differs per token
    rewards, mask = _outcome([1.0, 0.0, 2.0, 1.0], [3, 3, 2, 1])
    group = torch.tensor([0, 0, 1, 1])
    ours, _ = compute_reinforce_plus_plus_baseline(rewards, mask, group, gamma=0.5)
    verl, _ = compute_reinforce_plus_plus_baseline(rewards, mask, group, 0.5, target="score")
    # veRL: s_i = the discounted return at the first token; (s_i - group mean) on every token
    s = torch.tensor([0.25, 0.0, 1.0, 1.0], dtype=D)
    centred = s - torch.tensor([0.125, 0.125, 1.0, 1.0], dtype=D)
    expected = masked_whiten(centred[:, None].expand(4, 3) * mask, mask)
    torch.testing.assert_close(verl, expected)
    assert not torch.allclose(ours, verl)
    # gamma = 1, outcome reward only: both definitions agree
    a, _ = compute_reinforce_plus_plus_baseline(rewards, mask, group, gamma=1.0)
    b, _ = compute_reinforce_plus_plus_baseline(rewards, mask, group, 1.0, target="score")
    torch.testing.assert_close(a, b)


def test_kl_for_the_adaptive_controller() -> None:
    # row 0: KL [1, 1, 1]; row 1: KL [4, -, -]: token mean 7 / 4, mean of row means 2.5
    kl = torch.tensor([[1.0, 1.0, 1.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert kl_for_controller(kl, mask, "token-mean") == pytest.approx(1.75)
    assert kl_for_controller(kl, mask, "seq-mean") == pytest.approx(2.5)


def test_seq_mean_with_empty_rows_counted_or_not() -> None:
    loss = torch.ones(3, 2, dtype=D)
    mask = torch.tensor([[1, 1], [1, 0], [0, 0]])
    ours = aggregate_loss(loss, mask, LossNorm.for_batch(mask, "seq-mean-token-mean"))
    verl = aggregate_loss(
        loss, mask, LossNorm.for_batch(mask, "seq-mean-token-mean", count_empty_rows=False)
    )
    assert (ours.item(), verl.item()) == pytest.approx((2 / 3, 1.0))


def test_config_options_reach_the_estimators() -> None:
    cfg = load_config(RunConfig, None, ["algo.singleton_advantage=score"])
    assert _estimator_kwargs(cfg) == {"norm_by_std": True, "singleton": "score"}
    cfg = load_config(
        RunConfig,
        None,
        ["algo.advantage=reinforce_plus_plus_baseline", "algo.rfpp_baseline_target=score"],
    )
    assert _estimator_kwargs(cfg) == {"gamma": 1.0, "target": "score", "singleton": "zero"}


# The empty-row convention as a config key: one row of the step has no response token.
LOSS = torch.tensor([[1.0, 3.0], [2.0, 0.0], [0.0, 0.0]], dtype=D)
MASK = torch.tensor([[1, 1], [1, 0], [0, 0]])


def _cfg(*overrides: str) -> RunConfig:
    return load_config(RunConfig, None, list(overrides))


def _worker_norm(
    worker_cls: type, cfg: RunConfig, mask: torch.Tensor, parallelism: object = None
) -> LossNorm:
    """The worker's own ``_loss_norm`` on a mini-batch with ``mask`` (max response 2), under
    ``parallelism`` (default one process)."""
    from relayrl.workers.parallel import SingleProcess

    parallelism = parallelism if parallelism is not None else SingleProcess()
    holder = SimpleNamespace(algo=cfg.algo, max_response_tokens=2, parallelism=parallelism)
    return worker_cls._loss_norm(holder, SimpleNamespace(response_mask=mask))


@pytest.mark.parametrize(
    "agg, counted, skipped",
    [
        # row sums 4, 2, 0; row means 2, 2, 0; 3 tokens; 3 rows counted, 2 skipping the empty
        ("seq-mean-token-mean", 4 / 3, 4 / 2),
        ("seq-mean-token-sum", 6 / 3, 6 / 2),
        ("seq-mean-token-sum-norm", 6 / (3 * 2), 6 / (2 * 2)),
        ("token-mean", 6 / 3, 6 / 3),
    ],
)
def test_empty_row_key_reaches_actor_and_critic(agg: str, counted: float, skipped: float) -> None:
    for key, want in (("count", counted), ("skip", skipped)):
        cfg = _cfg(f"algo.loss_agg={agg}", f"algo.seq_mean_empty_rows={key}")
        norm = _worker_norm(ActorWorker, cfg, MASK)
        assert aggregate_loss(LOSS, MASK, norm).item() == pytest.approx(want), (agg, key)
        critic = _worker_norm(CriticWorker, cfg, MASK)
        assert critic.global_seqs == (3 if key == "count" else 2)
        assert critic.norm_constant == norm.norm_constant == 2.0  # Dr.GRPO's: max response
        assert aggregate_loss(LOSS, MASK, critic).item() == pytest.approx(want), (agg, key)


def _dp_rank(rank: int, store: str, out: str) -> None:
    """Rank 0 holds rows 0-1 of a 5-row step, rank 1 rows 2-4; rows 1, 3, 4 are empty."""
    import torch.distributed as dist

    from relayrl.workers.data_parallel import ReplicatedDataParallel

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    masks = [torch.tensor([[1, 1], [0, 0]]), torch.tensor([[1, 0], [0, 0], [0, 0]])]
    losses = [torch.tensor([[1.0, 3.0], [0.0, 0.0]], dtype=D), torch.zeros(3, 2, dtype=D)]
    losses[1][0, 0] = 2.0
    res = {}
    for key in ("count", "skip"):
        cfg = _cfg("algo.loss_agg=seq-mean-token-mean", f"algo.seq_mean_empty_rows={key}")
        norm = _worker_norm(ActorWorker, cfg, masks[rank], ReplicatedDataParallel())
        part = aggregate_loss(losses[rank], masks[rank], norm).reshape(1)
        dist.all_reduce(part)
        res[key] = (norm.global_tokens, norm.global_seqs, float(part))
    if rank == 0:
        torch.save(res, out)
    leave_process_group()


def test_data_parallel_normaliser_is_the_actors(tmp_path) -> None:
    """One gloo rank in this process: the data-parallel actor's normaliser (counts summed by a
    real all_reduce) gives the single-process actor's figures for both keys."""
    import torch.distributed as dist

    from relayrl.workers.data_parallel import ReplicatedDataParallel

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    store = f"file://{tmp_path / 'store'}"
    dist.init_process_group("gloo", init_method=store, rank=0, world_size=1)
    try:
        for key in ("count", "skip"):
            cfg = _cfg("algo.loss_agg=seq-mean-token-mean", f"algo.seq_mean_empty_rows={key}")
            dp = _worker_norm(ActorWorker, cfg, MASK, ReplicatedDataParallel())
            assert dp == _worker_norm(ActorWorker, cfg, MASK)
            assert dp.global_seqs == (3.0 if key == "count" else 2.0)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_data_parallel_actor_counts_empty_rows_as_configured(tmp_path) -> None:
    """Summed over two ranks: row means 2 and 2 over 5 rows (count) or the 2 non-empty (skip),
    the single-process normaliser's figures on the whole step (slow: two spawned ranks import
    the workers: 28 s at load 9 on 2 cores, a minute at load 18)."""
    import torch.multiprocessing as mp

    out = tmp_path / "res.pt"
    mp.spawn(_dp_rank, args=(str(tmp_path / "store"), str(out)), nprocs=2, join=True)
    res = torch.load(out)
    assert res["count"] == pytest.approx((3.0, 5.0, 4 / 5))
    assert res["skip"] == pytest.approx((3.0, 2.0, 4 / 2))
