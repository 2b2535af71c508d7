"""FSDP2 over gloo on the CPU: 2 ranks on uneven shards give the weights, statistics and
values of 1 process on the whole batch (float64, 1e-9) for actor and critic; the full weights
are gathered in bounded buckets; a sharded checkpoint resumes exactly. The same two ranks: a
LoRA actor data-parallel over them (replicated base and adapters, rank 0's initial adapters
broadcast, only the adapters' gradients all-reduced) gives the adapters and merged weights of
one process; an FSDP2 actor with ``model.fsdp.cpu_offload`` runs the offload code path and
gives the weights of one process without it."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from dp_ranks import train_lora
from fsdp_ranks import BF16, rank_main, reference_logprobs, train_actor, train_critic
from relayrl.model import build_tiny_model, load_causal_lm

TOL = 1e-9


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp")
    model = build_tiny_model(root / "m", hidden_size=16)
    rendezvous = str(root / "rendezvous")
    mp.spawn(rank_main, args=(2, rendezvous, str(model), str(root)), nprocs=2, join=True)
    return model, torch.load(root / "rank0.pt", weights_only=False)


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def test_actor_two_ranks_equal_one_process(two_ranks):
    model, got = two_ranks
    actor, stats = train_actor(model, 0, 0)  # world 0: plain ActorWorker, the whole batch
    assert _max_diff(got["actor"], actor.state_dict()) < TOL
    for k in ("actor/grad_norm", "actor/optimizer_steps"):  # loss: rank 0's part only
        assert got["stats"][0][k] == pytest.approx(stats[0][k], abs=TOL), k


def test_bf16_two_ranks_match_one_process_within_tolerance(two_ranks):
    """bf16 compute (FSDP2: bf16 parameter casts, fp32 reduce; 1 process: autocast) on fp32
    master weights: trainer logprobs within 0.02, the global gradient norm within 2%."""
    model, got = two_ranks
    _, stats = train_actor(model, 0, 0, opts=BF16)
    ranks, one = got["bf16"][0], stats[0]
    assert float((ranks["old_logprobs"] - one["old_logprobs"][:5]).abs().max()) < 0.02
    assert ranks["actor/grad_norm"] == pytest.approx(one["actor/grad_norm"], rel=0.02)


def test_critic_two_ranks_equal_one_process(two_ranks):
    model, got = two_ranks
    critic, stats = train_critic(model, 0, 0)
    assert _max_diff(got["critic"], critic.model.state_dict()) < TOL
    assert float((got["values"] - stats["values"][:5]).abs().max()) < TOL  # rank 0's rows


def test_sharded_reference_equals_one_process(two_ranks):
    model, got = two_ranks
    one = reference_logprobs(model, 0, 0)
    assert float((got["reference"] - one[:5]).abs().max()) < TOL


def test_full_weights_gathered_in_bounded_buckets(two_ranks):
    _, got = two_ranks
    sizes = got["buckets"]
    assert len(sizes) > 1
    assert all(nbytes <= 4096 or count == 1 for nbytes, count in sizes), sizes


def test_sharded_checkpoint_resumes_exactly(two_ranks):
    _, got = two_ranks
    assert got["straight"].keys() == got["resumed"].keys()
    for k, v in got["straight"].items():
        assert torch.equal(v, got["resumed"][k]), k


def test_lora_data_parallel_equals_one_process(two_ranks):
    model, got = two_ranks
    assert got["lora_parallelism"] == "ReplicatedDataParallel" and got["lora_option"]
    one, stats = train_lora(model, 0, 0)
    adapters = {n: p.detach() for n, p in one.model.named_parameters() if p.requires_grad}
    assert adapters and all(".lora_" in n for n in adapters)
    assert _max_diff(got["lora_adapters"], adapters) < TOL
    assert _max_diff(got["lora_merged"], one.state_dict()) < TOL
    base = load_causal_lm(model, torch.float64).state_dict()
    assert _max_diff(got["lora_merged"], base) > 1e-4  # the adapters moved the merged weights
    for a, b in zip(got["lora_stats"], stats, strict=True):
        assert a["actor/grad_norm"] == pytest.approx(b["actor/grad_norm"], abs=TOL)


def test_fsdp_cpu_offload_runs_and_equals_one_process(two_ranks):
    model, got = two_ranks
    assert got["offload_policy"] == "CPUOffloadPolicy"  # the offload path was taken
    assert got["offload_devices"] == ["cpu"]
    one, stats = train_actor(model, 0, 0, steps=2)  # one process, no FSDP, no offload
    assert _max_diff(got["offload"], one.state_dict()) < TOL
    for a, b in zip(got["offload_stats"], stats, strict=True):
        assert a["actor/grad_norm"] == pytest.approx(b["actor/grad_norm"], abs=TOL)


def test_lora_on_fsdp_two_ranks_equal_one_process(two_ranks):
    """LoRA on an FSDP2-sharded base (2 ranks, uneven shards): the adapters (the peft state
    the checkpoint saves), the merged engine weights and the gradient norms equal one
    process's (float64, 1e-9); the reference (adapters disabled) is the base model's."""
    model, got = two_ranks
    assert got["fsdp_lora_parallelism"] == "Fsdp2Sharded" and got["fsdp_lora_option"]
    assert got["fsdp_lora_ref_shares"]  # adapters off on the actor's model, its padder
    one, stats = train_lora(model, 0, 0)
    peft = got["fsdp_lora_peft"]
    want = one.model.state_dict()
    assert peft.keys() == want.keys() and any(".lora_A." in k for k in peft)
    assert _max_diff(peft, want) < TOL
    assert _max_diff(got["fsdp_lora_merged"], one.state_dict()) < TOL
    base = load_causal_lm(model, torch.float64).state_dict()
    assert _max_diff(got["fsdp_lora_merged"], base) > 1e-4  # the adapters moved the weights
    for a, b in zip(got["fsdp_lora_stats"], stats, strict=True):
        assert a["actor/grad_norm"] == pytest.approx(b["actor/grad_norm"], abs=TOL)
    base_ref = reference_logprobs(model, 0, 0)  # plain base model, whole batch
    assert float((got["fsdp_lora_reference"] - base_ref[:5]).abs().max()) < TOL
