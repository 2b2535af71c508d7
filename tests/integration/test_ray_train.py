"""The trainer on a real local Ray cluster (2 CPUs): the same controller code runs GRPO sync
with all roles colocated (and gives the local backend's run step for step) and async with
rollout and trainer on split pools; a data-parallel actor and critic of size 2 give the
gradients of size 1; an async run survives a killed rollout replica; a killed trainer stops the
run and ``resume`` continues it. The rollout replicas themselves (restarts, weight sync,
``top_logprobs``): test_ray_backend.py."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import torch

from helpers import run_config
from ray_local import ray_local

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ray = pytest.importorskip("ray")

from relayrl.cluster.local import build_local_roles  # noqa: E402
from relayrl.cluster.ray_roles import build_ray_roles  # noqa: E402
from relayrl.controller.algorithms import make_requests  # noqa: E402
from relayrl.controller.checkpoint import latest_checkpoint  # noqa: E402
from relayrl.controller.trainer import train  # noqa: E402
from relayrl.data.prompts import PromptSource  # noqa: E402
from relayrl.model import load_causal_lm, load_critic  # noqa: E402
from relayrl.workers import ActorWorker, CriticWorker, Experience  # noqa: E402

SPLIT = [
    "ray.pools={trainer: {bundles: 1}, rollout: {bundles: 1}}",
    "ray.placement={actor: trainer, reference: trainer, rollout: rollout}",
]


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    with ray_local():
        yield


def _metrics(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _train(cfg, seen=None):
    """Train on Ray; ``seen`` gets the (pid, roles) of the actor's and the rollout's process."""

    def build(a, c):
        roles = build_ray_roles(cfg, a, c)
        if seen is not None:
            actor = ray.get(roles.actor.group.hosts[0].ready.remote())
            rollout = ray.get(roles.rollout.replica(0).ready.remote())
            seen.extend([actor, rollout])
        return roles

    return train(cfg, build)


SMALL = ["algo.prompts_per_step=32", "algo.group_size=8", "data.eval_size=200", "optim.lr=3e-4"]
"""Half the default batch, 40 steps: at the default lr 5e-4 the held-out gain over seeds 0-4
was 0.015 / 0.11 (sync, min / median) and 0.015 / 0.035 (async split pools); 3e-4 learns
steadily from the small batches."""


@pytest.mark.learning
def test_grpo_sync_all_roles_colocated(sft_model, tmp_path, outcome):
    """Held-out gain, measured over seeds 0-4 (min / median): 0.09 / 0.155, and on seed 0 with
    other CPU kernels under load 0.055 (avx2) / 0.05 (default); the local backend
    then reproduces the run step for step (an exactness check, not a learning one)."""
    cfg = run_config(sft_model, tmp_path / "sync", "cluster=ray", "train.steps=40", *SMALL)
    seen = []
    out = _train(cfg, seen)
    outcome(before=out["eval_before"], after=out["eval_after"])
    assert out["eval_after"] >= out["eval_before"] + 0.025, out
    actor, rollout = seen
    # colocated: actor, reference and rollout engine share the pool's single process
    assert actor["pid"] == rollout["pid"] and "rollout" in actor["roles"]
    rows = [r for r in _metrics(tmp_path / "sync") if "reward_mean" in r]
    assert len(rows) == 40 and all(r["staleness_max"] == 0 for r in rows)
    # the same controller on the local backend: the same run, step for step
    local_cfg = run_config(sft_model, tmp_path / "local", "train.steps=40", *SMALL)
    local_out = train(local_cfg, lambda a, c: build_local_roles(local_cfg, a, c))
    assert local_out["eval_after"] == pytest.approx(out["eval_after"], abs=1e-6)
    local_rows = [r for r in _metrics(tmp_path / "local") if "reward_mean" in r]
    for a, b in zip(rows, local_rows, strict=True):
        assert a["reward_mean"] == pytest.approx(b["reward_mean"], abs=1e-6)


@pytest.mark.learning
def test_async_rollout_and_trainer_on_split_pools(sft_model, tmp_path, outcome):
    """Async eta 2 across two Ray pools learns: the training pass rate (mean of the last 10
    steps minus the first 10, 2,560 samples each) rose over seeds 0-4 by 0.076 / 0.141
    (min / median), and on seed 0 with other CPU kernels under load by 0.121 (avx2) / 0.034
    (default); a broken algorithm (advantages negated) by -0.113. The held-out greedy pass
    rate is recorded, not asserted: it rose by 0.0 / 0.135 (seed 0 ended on exactly its start,
    63 of 200, also when its final checkpoint is evaluated on its own), too noisy a signal for
    80 steps of this small batch."""
    cfg = run_config(
        sft_model,
        tmp_path / "async",
        "cluster=ray",
        "schedule=async",
        "async.eta=2",
        "train.steps=80",
        *SMALL,
        *SPLIT,
    )
    seen = []
    out = _train(cfg, seen)
    rows = [r for r in _metrics(tmp_path / "async") if "reward_mean" in r]
    first, last = (sum(r["reward_mean"] for r in part) / 10 for part in (rows[:10], rows[-10:]))
    outcome(before=out["eval_before"], after=out["eval_after"], train_rise=last - first)
    assert last >= first + 0.015, (first, last)
    actor, rollout = seen
    assert actor["pid"] != rollout["pid"] and rollout["roles"] == ["rollout"]
    assert max(r["staleness_max"] for r in rows) <= 2
    assert max(r["staleness_max"] for r in rows) >= 1  # the pools really ran concurrently
    assert out["engine"]["replicas"] == 1 and out["engine"]["weight_updates"] >= 80
    assert out["engine"]["weight_sync_s"] > 0


def test_data_parallel_actor_of_two_gives_the_gradients_of_one(sft_model, tmp_path):
    """Float64: a DP=2 actor and critic (two Ray actors, gloo all-reduce, global loss counts)
    and a single local actor / critic give the same gradients and weights on one batch."""
    cfg = run_config(
        sft_model,
        tmp_path / "dp",
        "cluster=ray",
        "algo.name=ppo",
        "algo.loss_agg=seq-mean-token-mean",
        "model.dtype=float64",
        "algo.prompts_per_step=8",
        "algo.group_size=4",
        "algo.mini_batches=1",
        "algo.micro_batch_size=5",
        "ray.pools={main: {bundles: 2, cpus_per_bundle: 0.5}}",
    )
    roles = build_ray_roles(cfg, str(sft_model), None)
    try:
        assert roles.actor.group.size == 2
        tok = roles.tokenizer
        prompts = PromptSource(cfg.data, tok, 0).for_step(0, 8)
        samples = roles.rollout.generate(make_requests(prompts, cfg, 0, [tok.eos_token_id]))
        exp = Experience.from_samples(samples, tok.pad_token_id)
        local = ActorWorker.from_config(load_causal_lm(sft_model, torch.float64), cfg)
        exp.old_logprobs = roles.actor.compute_logprobs(exp)  # split by rank, gathered
        torch.testing.assert_close(
            exp.old_logprobs, local.compute_logprobs(exp), atol=1e-10, rtol=0
        )
        exp.advantages = torch.randn(
            exp.response_mask.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64
        )
        dp_stats = roles.actor.update(exp)
        local_stats = local.update(exp)
        for key in ("actor/grad_norm", "actor/loss"):
            assert dp_stats[key] == pytest.approx(local_stats[key], abs=1e-9)
        want = {n: p.grad for n, p in local.model.named_parameters() if p.grad is not None}
        for host in roles.actor.group.hosts:  # both ranks hold the all-reduced gradient
            got = ray.get(host.gradients.remote("actor"))
            assert got.keys() == want.keys()
            for n, g in want.items():
                torch.testing.assert_close(got[n], g, atol=1e-9, rtol=0)
        for n, p in roles.actor.model.state_dict().items():
            torch.testing.assert_close(p, local.model.state_dict()[n], atol=1e-9, rtol=0)
        # the critic: the same on its value loss
        local_critic = CriticWorker.from_config(load_critic(sft_model, torch.float64), cfg)
        exp.values = roles.critic.compute_values(exp)
        torch.testing.assert_close(exp.values, local_critic.compute_values(exp), atol=1e-10, rtol=0)
        exp.returns = torch.randn(
            exp.response_mask.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64
        )
        dp_c = roles.critic.update(exp)
        local_c = local_critic.update(exp)
        assert dp_c["critic/vf_loss"] == pytest.approx(local_c["critic/vf_loss"], abs=1e-9)
        want = {n: p.grad for n, p in local_critic.model.named_parameters() if p.grad is not None}
        for host in roles.critic.group.hosts:
            got = ray.get(host.gradients.remote("critic"))
            assert got.keys() == want.keys()
            for n, g in want.items():
                torch.testing.assert_close(got[n], g, atol=1e-9, rtol=0)
    finally:
        roles.close()


def _when(predicate, action, timeout=120.0):
    """Run ``action`` in a thread as soon as ``predicate()`` holds."""

    def watch():
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                action()
                return
            time.sleep(0.05)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def _logged_steps(run_dir):
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    return sum(1 for x in path.read_text().splitlines() if '"reward_mean"' in x)


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["object_store", "collective"])
def test_async_run_survives_a_killed_replica(sft_model, tmp_path, transport):
    """Overlap schedule, two replicas; one is killed mid-run: every step still gets its full
    groups (a lost sample would hang the group, a duplicate would be dropped and counted).
    ``collective``: killed by os.kill of its pid; the weight group is formed again once
    (generation 1) and the replicas end at the final version.
    Slow: the default run keeps the async kill-and-restart tests (~17 s each on 2 cores)."""
    run = tmp_path / "survive"
    cfg = run_config(
        sft_model,
        run,
        f"weight_sync.transport={transport}",
        "cluster=ray",
        "schedule=overlap",
        "train.steps=10",
        "algo.prompts_per_step=8",
        "algo.group_size=4",
        "data.eval_size=8",
        "rollout.max_slots=4",
        "ray.pools={trainer: {bundles: 1}, rollout: {bundles: 2, cpus_per_bundle: 0.5}}",
        "ray.placement={actor: trainer, rollout: rollout}",
        "ray.rollout_replicas=2",
    )
    built = []

    def build(a, c):
        built.append(build_ray_roles(cfg, a, c))
        return built[-1]

    def kill_replica_0():
        replica = built[0].rollout.replica(0)
        if transport == "collective":
            os.kill(ray.get(replica.ready.remote())["pid"], 9)
        else:
            ray.kill(replica, no_restart=True)

    killer = _when(lambda: _logged_steps(run) >= 3, kill_replica_0)
    out = train(cfg, build)
    killer.join()
    assert _logged_steps(run) == 10
    assert out["engine"]["replica_restarts"] == 1
    assert out["engine"]["duplicates_dropped"] == 0
    if transport == "collective":
        assert built[0].rollout._members.generation == 1
        assert out["engine"]["version"] == 10
    # No staleness assertion here: with ``async.in_order: false`` a resubmitted group
    # completes late and is consumed after younger ones, so its early samples can be one step
    # staler than eta; in order (the default) the trainer waits for it instead.


def test_trainer_death_stops_the_run_and_resume_continues(sft_model, tmp_path):
    run = tmp_path / "dead"
    common = [
        "cluster=ray",
        "schedule=async",
        "train.save_every=2",
        "algo.prompts_per_step=8",
        "algo.group_size=4",
        "data.eval_size=8",
        *SPLIT,
    ]
    cfg = run_config(sft_model, run, "train.steps=200", *common)
    built = []

    def build(a, c):
        built.append(build_ray_roles(cfg, a, c))
        return built[-1]

    killer = _when(
        lambda: latest_checkpoint(run) is not None,
        lambda: ray.kill(built[0].actor.group.hosts[0], no_restart=True),
    )
    with pytest.raises(ray.exceptions.RayActorError):
        train(cfg, build)
    killer.join()
    done = int(latest_checkpoint(run).name.split("_")[1])
    resumed = run_config(sft_model, run, f"train.steps={done + 2}", *common)
    train(resumed, lambda a, c: build_ray_roles(resumed, a, c), resume=True)
    steps = [r["step"] for r in _metrics(run) if "reward_mean" in r]
    assert steps == sorted(set(steps)) and steps[-1] == done + 2
