"""The ``ray`` cluster's rollout replicas on a real local Ray cluster (2 CPUs): a killed
replica is restarted with no sample lost or duplicated (and one that keeps dying stops the run);
``weight_sync.transport=collective`` leaves every engine weight equal to the object-store payload,
also after a replica is killed or stopped mid-sync; the replicas serve ``top_logprobs``. The
trainer on Ray (sync, async, data parallel, a killed trainer): test_ray_train.py."""

from __future__ import annotations

import contextlib
import os
import re
import time

import pytest
import torch

from helpers import run_config
from ray_local import ray_local

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ray = pytest.importorskip("ray")

from relayrl.cluster.ray_roles import build_ray_roles  # noqa: E402
from relayrl.cluster.ray_rollout import RolloutReplicaDied  # noqa: E402
from relayrl.controller.algorithms import make_requests  # noqa: E402
from relayrl.controller.failures import InfraBudgetExceeded  # noqa: E402
from relayrl.data.prompts import PromptSource  # noqa: E402
from relayrl.model import load_causal_lm  # noqa: E402
from relayrl.rollout import GenerationRequest, SamplingParams  # noqa: E402
from relayrl.workers import Experience  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    with ray_local():
        yield


RETRIED: list[int] = []  # uids of samples tagged as resubmitted by _submit_killing_replica_0


def _submit_killing_replica_0(client, prompt, n, length):
    """Submit ``n`` requests (balanced over the two replicas) and poll until their samples
    arrived, killing replica 0 once 4 are in while it still has requests in flight:
    (uids, versions of every token)."""
    params = SamplingParams(max_tokens=length, ignore_eos=True, seed=7)
    client.submit_many([GenerationRequest(prompt, params, metadata={"uid": i}) for i in range(n)])
    load = client.outstanding_tokens()
    assert len(load) == 2 and load[0] == load[1] > 0  # balanced by outstanding tokens
    got: list[int] = []
    versions: set[int] = set()
    killed = False
    deadline = time.monotonic() + 180
    while len(got) < n and time.monotonic() < deadline:
        for s in client.poll(timeout=0.2):
            got.append(s.metadata["uid"])
            if s.metadata.get("retried"):  # resubmitted: tagged with the cause (issue 43)
                assert [r["cause"] for r in s.metadata["retried"]] == ["replica_lost"]
                assert "rollout replica 0 died" in s.metadata["retried"][0]["error"]
                RETRIED.append(s.metadata["uid"])
            versions.update(s.versions)
            assert s.error is None and len(s.response_ids) == length
        if not killed and len(got) >= 4 and client.outstanding_tokens()[0] > 0:
            ray.kill(client.replica(0), no_restart=True)
            killed = True
    assert killed
    return got, versions


def test_killed_rollout_replica_is_restarted_without_losing_or_duplicating(sft_model, tmp_path):
    cfg = run_config(
        sft_model,
        tmp_path / "kill",
        "cluster=ray",
        "schedule=async",
        "ray.pools={trainer: {bundles: 1}, rollout: {bundles: 2, cpus_per_bundle: 0.5}}",
        "ray.placement={actor: trainer, rollout: rollout}",
        "ray.rollout_replicas=2",
        "rollout.max_slots=4",  # requests finish in waves: many still in flight at the kill
        "ray.max_replica_restarts=1",
    )
    roles = build_ray_roles(cfg, str(sft_model), None)
    client = roles.rollout
    try:
        client.update_weights(roles.actor.state_dict(), version=1, interrupt=False)
        n = 96
        RETRIED.clear()
        got, versions = _submit_killing_replica_0(client, roles.tokenizer.encode("12+34="), n, 48)
        time.sleep(0.5)
        late = client.poll(timeout=0.2)
        got.extend(s.metadata["uid"] for s in late)
        RETRIED.extend(s.metadata["uid"] for s in late if s.metadata.get("retried"))
        assert sorted(got) == list(range(n)), "a sample was lost or duplicated"
        assert client.restarts == 1 and client.resubmitted > 0
        assert len(set(RETRIED)) == len(RETRIED) == client.resubmitted  # exactly those tagged
        assert versions == {1}  # the restarted replica came back with the current weights
        stats = client.report().counters
        assert stats["replica_restarts"] == 1 and stats["replicas"] == 2
        # A replica that keeps dying stops the run (issue 43): its one restart is spent, so
        # the next death is a RolloutReplicaDied, an InfraBudgetExceeded (the trainer's one
        # line, exit 1) naming replica_lost and its last error, at the next client call.
        ray.kill(client.replica(0), no_restart=True)
        deadline = time.monotonic() + 60
        with pytest.raises(RolloutReplicaDied) as info:
            while time.monotonic() < deadline:
                client.poll(timeout=0.2)
        msg = str(info.value)
        assert isinstance(info.value, InfraBudgetExceeded) and "\n" not in msg
        assert msg.startswith("rollout replica 0 died after 1 restarts")
        assert "(ray.max_replica_restarts=1)" in msg and "mostly replica_lost" in msg
        assert re.search(r"last error: \w*Actor\w*Error: ", msg), msg  # ActorDiedError
    finally:
        roles.close()


COLLECTIVE_TWO_REPLICAS = [
    "cluster=ray",
    "weight_sync.transport=collective",
    "weight_sync.timeout_s=60",
    "model.fsdp.sync_bucket_mb=0.05",  # several buckets
    "ray.pools={trainer: {bundles: 1, cpus_per_bundle: 0.5}, "
    "rollout: {bundles: 2, cpus_per_bundle: 0.5}}",
    "ray.placement={actor: trainer, rollout: rollout}",
    "ray.rollout_replicas=2",
    "rollout.max_slots=4",  # requests finish in waves: many still in flight at the kill
]


def _update_actor(roles, cfg, step):
    """One actor update on a fresh batch (random advantages): the actor's weights change."""
    tok = roles.tokenizer
    prompts = PromptSource(cfg.data, tok, 0).for_step(step, 4)
    samples = roles.rollout.generate(make_requests(prompts, cfg, step, [tok.eos_token_id]))
    exp = Experience.from_samples(samples, tok.pad_token_id)
    exp.old_logprobs = roles.actor.compute_logprobs(exp)
    exp.advantages = torch.randn(
        exp.response_mask.shape, generator=torch.Generator().manual_seed(step)
    )
    roles.actor.update(exp)


def _wait_for(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _assert_engines_hold_the_actor(roles, version):
    want = ray.get(roles.actor.state_dict().ref)
    for i in range(roles.rollout.num_replicas):
        got = ray.get(roles.rollout.replica(i).engine_state.remote())
        assert int(got.pop("__version__")) == version, i
        assert got.keys() == want.keys()
        for k, v in want.items():
            assert torch.equal(got[k], v), (i, k)


def test_collective_weight_sync_equals_the_object_store_payload(sft_model, tmp_path):
    """``weight_sync.transport=collective`` on split pools: trainer rank 0 and the replica in a
    gloo group of their own, weights broadcast in small buckets after one actor update; the
    replica's engine then holds exactly (torch.equal) the state dict the object-store path
    ships (rank 0's ``RemoteStateDict``), at the client's version, and samples carry it
    (several receivers: tests/unit/cluster/test_weight_collective.py). Then the replica is
    killed and comes back through a re-formed group with the same weights."""
    cfg = run_config(
        sft_model,
        tmp_path / "coll",
        "cluster=ray",
        "weight_sync.transport=collective",
        "model.fsdp.sync_bucket_mb=0.05",  # several buckets
        "algo.prompts_per_step=4",
        "algo.group_size=2",
        "ray.pools={trainer: {bundles: 1, cpus_per_bundle: 0.5}, "
        "rollout: {bundles: 1, cpus_per_bundle: 0.5}}",
        "ray.placement={actor: trainer, rollout: rollout}",
    )
    roles = build_ray_roles(cfg, str(sft_model), None)
    client = roles.rollout
    try:
        assert client._collective
        tok = roles.tokenizer
        prompts = PromptSource(cfg.data, tok, 0).for_step(0, 4)
        samples = client.generate(make_requests(prompts, cfg, 0, [tok.eos_token_id]))
        exp = Experience.from_samples(samples, tok.pad_token_id)
        exp.old_logprobs = roles.actor.compute_logprobs(exp)
        exp.advantages = torch.randn(
            exp.response_mask.shape, generator=torch.Generator().manual_seed(0)
        )
        roles.actor.update(exp)
        client.update_weights(roles.actor.state_dict(), version=1, interrupt=True)
        assert client.version == 1 and client.last_sync_s > 0
        want = ray.get(roles.actor.state_dict().ref)  # what object_store would have shipped
        initial = roles.actor._load_shadow().state_dict()
        for i in range(client.num_replicas):
            got = ray.get(client.replica(i).engine_state.remote())
            assert int(got.pop("__version__")) == 1
            assert got.keys() == want.keys()
            changed = 0
            for k, v in want.items():
                assert torch.equal(got[k], v), k
                changed += int(not torch.equal(v, initial[k]))
            assert changed > 0  # the update moved weights: the sync carried new values
        after = client.generate(make_requests(prompts, cfg, 1, [tok.eos_token_id]))
        assert all(set(s.versions) == {1} for s in after)
        # the replica dies (the only one: none serves meanwhile): it is restarted from the
        # initial weights as version -1, the group formed again (generation 1) and its first
        # sync loads version 1; requests wait for it, so every sample carries version 1
        ray.kill(client.replica(0), no_restart=True)
        again = client.generate(make_requests(prompts, cfg, 2, [tok.eos_token_id]))
        assert all(set(s.versions) == {1} for s in again)
        assert client.restarts == 1 and client._members.generation == 1
        _assert_engines_hold_the_actor(roles, 1)
    finally:
        roles.close()


def _generate_on(client, index, n, version):
    """``n`` samples, all at ``version``; replica ``index`` produced some of their tokens."""
    params = SamplingParams(max_tokens=16, ignore_eos=True, seed=3)
    before = ray.get(client.replica(index).rollout_stats.remote())[0]["tokens_generated"]
    out = client.generate([GenerationRequest([3, 4, 5], params) for _ in range(n)])
    assert all(set(s.versions) == {version} for s in out)
    after = ray.get(client.replica(index).rollout_stats.remote())[0]["tokens_generated"]
    assert after > before  # the replica serves requests


@pytest.mark.slow
def test_killed_replica_rejoins_the_collective_weight_group(sft_model, tmp_path):
    """``weight_sync.transport=collective``, two replicas, the actor updated and synced as
    version 1. (1) Replica 0 is killed with requests in flight while the actor still holds
    the version last sent: it is restarted (from the initial weights, as version -1), the
    weight group formed again (generation 1, the same ranks) and the new replica loads
    version 1 as the new group's first sync before it gets a request: none is lost or
    duplicated, every sample carries version 1, both engines equal the actor (torch.equal).
    (2) The actor is updated, then replica 1 is killed and the next sync starts at once: it
    finds the replica dead (through Ray), waits for its restart and the re-formed group
    (which could not send the changed weights), and delivers version 2 to both engines.
    Slow (~40 s on 2 loaded cores); the default run restarts a replica in
    ``test_collective_weight_sync_equals_the_object_store_payload``."""
    cfg = run_config(
        sft_model,
        tmp_path / "kc",
        *COLLECTIVE_TWO_REPLICAS,
        "algo.prompts_per_step=4",
        "algo.group_size=2",
    )
    roles = build_ray_roles(cfg, str(sft_model), None)
    client = roles.rollout
    try:
        assert client._members.generation == 0
        _update_actor(roles, cfg, 0)
        client.update_weights(roles.actor.state_dict(), version=1, interrupt=False)
        n = 48
        got, versions = _submit_killing_replica_0(client, roles.tokenizer.encode("12+34="), n, 32)
        assert sorted(got) == list(range(n)), "a sample was lost or duplicated"
        _wait_for(client.replicas_ready)  # the re-formation may outlast the requests
        assert client.restarts == 1 and client.resubmitted > 0
        assert versions == {1}
        assert client._members.generation == 1
        _assert_engines_hold_the_actor(roles, 1)
        _generate_on(client, 0, 8, 1)
        # (2) the actor moved on since the last sync: the re-formation cannot send it; the
        # next update_weights (started right after the kill) does, to both replicas
        _update_actor(roles, cfg, 1)
        dead = client.replica(1)
        ray.kill(dead, no_restart=True)
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(dead.ready.remote(), timeout=30)
        client.update_weights(roles.actor.state_dict(), version=2, interrupt=False)
        assert client.restarts == 2 and client._members.generation == 2
        _assert_engines_hold_the_actor(roles, 2)
        _generate_on(client, 1, 8, 2)
        assert client.report().counters["version"] == 2
    finally:
        roles.close()


@pytest.mark.parametrize("transport", ["collective", "object_store"])
def test_weight_sync_to_a_stopped_replica_restarts_it_within_the_bound(
    sft_model, tmp_path, monkeypatch, caplog, transport
):
    """Issue 43, item 4: one replica whose process is stopped (SIGSTOP: alive for Ray, taking
    part in nothing); ``update_weights`` to version 1 does not hang. ``collective``: the probe
    before the sync gets no answer within 30 s (or, stopped after it, the sender's broadcast
    fails after ``weight_sync.timeout_s`` and the replica's part has not returned
    ``STUCK_GRACE_S`` later); ``object_store``: its load has not returned within
    ``weight_sync.timeout_s``. Either way the replica is named with the version and killed,
    restarted (the group re-formed), and version 1 reaches the new engine. Bounded by probe +
    timeout + grace + a restart's slack, never a ratio of timings."""
    import signal

    from relayrl.cluster import ray_weight_sync

    monkeypatch.setattr(ray_weight_sync, "STUCK_GRACE_S", 2.0)
    cfg = run_config(
        sft_model,
        tmp_path / "stop",
        "cluster=ray",
        f"weight_sync.transport={transport}",
        "weight_sync.timeout_s=5",
        "ray.pools={trainer: {bundles: 1, cpus_per_bundle: 0.5}, "
        "rollout: {bundles: 1, cpus_per_bundle: 0.5}}",
        "ray.placement={actor: trainer, rollout: rollout}",
    )
    roles = build_ray_roles(cfg, str(sft_model), None)
    client = roles.rollout
    pid = ray.get(client.replica(0).ready.remote())["pid"]
    try:
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with caplog.at_level("WARNING"):
            client.update_weights(roles.actor.state_dict(), version=1, interrupt=False)
        took = time.monotonic() - t0
        assert took < 30 + 5 + 2 + 120, took  # probe + timeout + grace + a loaded restart
        stuck = [r.getMessage() for r in caplog.records if "killing it" in r.getMessage()]
        assert stuck and stuck[0].startswith("weight sync of version 1: "), stuck
        assert "replica 0 did not" in stuck[0]
        with pytest.raises(ProcessLookupError):  # the stopped process was killed
            for _ in range(100):
                os.kill(pid, 0)
                time.sleep(0.1)
        _wait_for(lambda: client.restarts == 1 and client.replicas_ready(), timeout=180)
        assert client.version == 1
        ray.get(client.replica(0).ready.remote())
        _assert_engines_hold_the_actor(roles, 1)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        roles.close()


def _poll_all(client, requests):
    """``requests`` through ``submit_many`` and ``poll``: their samples, in order."""
    client.submit_many(
        [
            GenerationRequest(r.prompt_ids, r.params, metadata={"i": i})
            for i, r in enumerate(requests)
        ]
    )
    got: dict[int, object] = {}
    deadline = time.monotonic() + 120
    while len(got) < len(requests):
        assert time.monotonic() < deadline, "timed out"
        got.update((s.metadata["i"], s) for s in client.poll(timeout=0.5))
    return [got[i] for i in range(len(requests))]


def test_replicas_serve_top_logprobs(sft_model, tmp_path):
    """Ray replicas keep ``top_logprobs`` (before: the OpenAI endpoint answered 400): the
    client reports it (``supports_top_logprobs``, asked of the replicas' engines), and each
    sample's alternatives come back through Ray and ``poll``: per token those of a plain
    forward's recompute on the replica's weights (temperature, top-k, top-p; greedy; none
    when not asked; the same tokens as without them). Then the endpoint over the client, with
    the ``openai`` client: every token's alternatives, the sampled one among them, streamed
    (with the finish: no progress path) as not."""
    from openai_stream_checks import check_top_logprobs, template_tokenizer
    from relayrl.env.openai_server import OpenAIServer
    from rollout_helpers import check_top_recompute

    cfg = run_config(sft_model, tmp_path / "top", "cluster=ray", "rollout.max_slots=8")
    roles = build_ray_roles(cfg, str(sft_model), None)
    client = roles.rollout
    try:
        assert client.supports_top_logprobs is True
        model = load_causal_lm(sft_model).eval()
        check_top_recompute(model, lambda reqs: _poll_all(client, reqs))
        srv = OpenAIServer(client, template_tokenizer(sft_model))
        srv.start()
        try:
            check_top_logprobs(srv)
        finally:
            srv.stop()
    finally:
        roles.close()
