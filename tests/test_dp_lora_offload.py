"""Two gloo ranks on the CPU: a LoRA actor data-parallel over them (replicated base and
adapters, only the adapters' gradients all-reduced) gives the adapters and merged weights of
one process on the whole batch; an FSDP2 actor with ``model.fsdp.cpu_offload`` runs the
offload code path and gives the weights of one process without it (float64, 1e-9)."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from dp_ranks import rank_main, train_lora
from fsdp_ranks import train_actor
from relayrl.model import build_tiny_model, load_causal_lm

TOL = 1e-9


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("dp")
    model = build_tiny_model(root / "m", hidden_size=16)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    mp.spawn(rank_main, args=(2, port, str(model), str(root)), nprocs=2, join=True)
    return model, torch.load(root / "rank0.pt", weights_only=False)


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def test_lora_data_parallel_equals_one_process(two_ranks):
    model, got = two_ranks
    assert got["lora_class"] == "LoraDataParallelActorWorker"
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
