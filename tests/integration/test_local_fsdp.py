"""``model.fsdp.enabled`` on the local cluster: FSDP2 over a process group of this process
alone (world 1) trains exactly as the plain actor (float64), writes the sharded checkpoint,
and leaves the group when the run ends."""

from __future__ import annotations

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from helpers import run_config
from relayrl.cluster.local import build_local_roles
from relayrl.controller.trainer import train

COMMON = (
    "model.dtype=float64",
    "algo.prompts_per_step=4",
    "algo.group_size=4",
    "algo.kl_coef=0.05",
    "algo.micro_batch_size=3",
    "algo.mini_batches=1",
    "data.eval_size=4",
    "optim.lr=2e-3",
    "train.steps=2",
    "train.save_every=2",
)


def _weights(run):
    path = run / "checkpoints/step_000002/actor"
    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True).state_dict()


def test_local_fsdp_one_rank_trains_as_the_plain_actor(sft_model, tmp_path):
    runs = {}
    for fsdp in (False, True):
        run = tmp_path / f"fsdp_{fsdp}"
        cfg = run_config(sft_model, run, *COMMON, f"model.fsdp.enabled={str(fsdp).lower()}")
        train(cfg, lambda a, c, cfg=cfg: build_local_roles(cfg, a, c))
        runs[fsdp] = run
        assert not dist.is_initialized()  # the run left its process group
    assert (runs[True] / "checkpoints/step_000002/sharded_actor").is_dir()
    assert not (runs[False] / "checkpoints/step_000002/sharded_actor").exists()
    plain, sharded = _weights(runs[False]), _weights(runs[True])
    assert plain.keys() == sharded.keys()
    moved = 0.0
    for k in plain:
        assert float((plain[k] - sharded[k]).abs().max()) < 1e-9, k
    base = AutoModelForCausalLM.from_pretrained(sft_model, torch_dtype=torch.float64).state_dict()
    moved = max(float((plain[k] - base[k]).abs().max()) for k in plain)
    assert moved > 1e-4  # the two steps trained


def test_local_cluster_refuses_the_collective_weight_transport(sft_model, tmp_path):
    import pytest

    cfg = run_config(sft_model, tmp_path / "r", "weight_sync.transport=collective")
    with pytest.raises(ValueError, match="weight_sync.transport=collective needs cluster=ray"):
        build_local_roles(cfg, str(sft_model), None)
