"""``relayrl train`` with an FSDP2 actor and reference on 2 Ray ranks (gloo, 1 thread each):
2 steps, a sharded checkpoint, a resume for 1 more step give the weights of 3 steps straight
(bit for bit), the HF export ``actor/`` loads with plain ``from_pretrained``, and the run
equals the local 1-process run on the same global batches (float64: weights within 1e-9)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers import run_config
from ray_local import ray_local

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ray = pytest.importorskip("ray")

from relayrl.cluster.local import build_local_roles  # noqa: E402
from relayrl.cluster.ray_roles import build_ray_roles  # noqa: E402
from relayrl.controller.trainer import train  # noqa: E402

COMMON = (
    "model.dtype=float64",
    "algo.prompts_per_step=4",
    "algo.group_size=4",
    "algo.kl_coef=0.05",
    "algo.micro_batch_size=3",
    "algo.mini_batches=1",  # each rank's shard is its part of the one mini-batch
    "data.eval_size=4",
    "optim.lr=2e-3",
)
FSDP = (
    "cluster=ray",
    "model.fsdp.enabled=true",
    "model.fsdp.sync_bucket_mb=0.05",  # several buckets per weight sync
    "ray.pools={main: {bundles: 2, cpus_per_bundle: 0.5}}",
)
TOL = 1e-9


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    with ray_local():
        yield


def _ray_train(cfg, resume=False):
    return train(cfg, lambda a, c: build_ray_roles(cfg, a, c), resume=resume)


def _weights(run, step):
    path = run / f"checkpoints/step_{step:06d}/actor"
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)  # plain HF
    return model.state_dict()


def _rows(run):
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if "reward_mean" in r}


@pytest.fixture(scope="module")
def straight(sft_model, tmp_path_factory):
    """3 FSDP2 steps straight, checkpoints after steps 2 and 3."""
    run = tmp_path_factory.mktemp("fsdp_train") / "straight"
    _ray_train(run_config(sft_model, run, "train.steps=3", "train.save_every=2", *COMMON, *FSDP))
    return run


def test_fsdp_train_resumes_exactly_from_a_sharded_checkpoint(sft_model, straight, tmp_path):
    """The run directory as it was after step 2 (its step-2 checkpoint), resumed for 1 step."""
    ckpt = straight / "checkpoints/step_000002"
    state = torch.load(ckpt / "trainer_state.pt", weights_only=False)
    assert state["actor"] == {"sharded_dir": "sharded_actor"}
    assert (ckpt / "sharded_actor/.metadata").is_file()
    ranks = sorted(p.name for p in (ckpt / "sharded_actor").glob("rank_*.pt"))
    assert ranks == ["rank_0.pt", "rank_1.pt"]
    split = tmp_path / "split"
    shutil.copytree(ckpt, split / "checkpoints" / ckpt.name)
    (split / "checkpoints/latest").write_text(ckpt.name + "\n")
    shutil.copy(straight / "metrics.jsonl", split / "metrics.jsonl")
    _ray_train(run_config(sft_model, split, "train.steps=3", *COMMON, *FSDP), resume=True)
    a, b = _weights(straight, 3), _weights(split, 3)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    ra, rb = _rows(straight), _rows(split)
    assert sorted(ra) == sorted(rb) == [1, 2, 3]
    for key in ("reward_mean", "actor/loss", "actor/grad_norm", "actor/kl"):
        assert ra[3][key] == rb[3][key], key


def test_fsdp_train_equals_the_one_process_run(sft_model, straight, tmp_path):
    """The local 1-process run on the same global batches: weights within 1e-9 (float64)."""
    cfg = run_config(sft_model, tmp_path / "local", "train.steps=3", *COMMON)
    train(cfg, lambda p, c: build_local_roles(cfg, p, c))
    one, two = _weights(tmp_path / "local", 3), _weights(straight, 3)
    start = AutoModelForCausalLM.from_pretrained(sft_model, torch_dtype=torch.float64).state_dict()
    assert max(float((one[k] - start[k]).abs().max()) for k in one) > 1e-4  # they moved
    assert max(float((one[k] - two[k]).abs().max()) for k in one) < TOL
    r1, r2 = _rows(tmp_path / "local"), _rows(straight)
    for s in r2:
        assert r2[s]["reward_mean"] == r1[s]["reward_mean"]
        assert r2[s]["actor/grad_norm"] == pytest.approx(r1[s]["actor/grad_norm"], abs=TOL)


LORA_DP = (
    "cluster=ray",
    "model.lora.r=4",
    "model.lora.alpha=8",
    "model.lora.dropout=0.0",
    "ray.pools={main: {bundles: 2, cpus_per_bundle: 0.5}}",
)


@pytest.mark.slow
@pytest.mark.parametrize("fsdp", [False, True], ids=["replicas", "fsdp2"])
def test_lora_data_parallel_train_checkpoints_the_adapter_and_resumes(sft_model, tmp_path, fsdp):
    """LoRA on 2 data-parallel Ray ranks through train (replicated base, or an FSDP2-sharded
    base: sharded checkpoint): the checkpoint's ``actor/`` is the peft adapter, and 2 steps + a
    resume for 1 give the adapter of 3 steps straight."""
    from peft import PeftModel

    opts = (*LORA_DP, *(["model.fsdp.enabled=true", "model.fsdp.sync_bucket_mb=0.05"] * fsdp))
    a, b = tmp_path / "a", tmp_path / "b"
    _ray_train(run_config(sft_model, a, "train.steps=3", *COMMON, *opts))
    _ray_train(run_config(sft_model, b, "train.steps=2", *COMMON, *opts))
    assert (b / "checkpoints/step_000002/actor/adapter_config.json").is_file()
    assert (b / "checkpoints/step_000002/sharded_actor").is_dir() == fsdp
    _ray_train(run_config(sft_model, b, "train.steps=3", *COMMON, *opts), resume=True)

    def adapter(run):
        base = AutoModelForCausalLM.from_pretrained(sft_model, torch_dtype=torch.float64)
        peft = PeftModel.from_pretrained(base, run / "checkpoints/step_000003/actor")
        return {k: v for k, v in peft.state_dict().items() if "lora_" in k}

    wa, wb = adapter(a), adapter(b)
    assert wa and wa.keys() == wb.keys()
    assert any(float(v.abs().max()) > 0 for k, v in wa.items() if "lora_B" in k)  # trained
    for k in wa:
        assert float((wa[k] - wb[k]).abs().max()) < TOL, k


SPLIT_FSDP = (
    "cluster=ray",
    "model.fsdp.enabled=true",
    "model.fsdp.sync_bucket_mb=0.05",
    "ray.pools={trainer: {bundles: 2, cpus_per_bundle: 0.5}, "
    "rollout: {bundles: 1, cpus_per_bundle: 0.5}}",
    "ray.placement={actor: trainer, reference: trainer, rollout: rollout}",
)


@pytest.mark.slow
def test_fsdp_collective_weight_sync_gives_the_object_store_run(sft_model, tmp_path):
    """An FSDP2 actor on 2 ranks, the engine on a pool of its own: 3 sync steps with the
    weights broadcast over the weight group (every rank joins the gathers, rank 0 sends each
    bucket) give the run of the object-store transport step for step: same rewards, KL,
    entropy and lengths, and bit-identical final weights."""
    runs = {}
    for transport in ("object_store", "collective"):
        run = tmp_path / transport
        cfg = run_config(
            sft_model,
            run,
            "train.steps=3",
            "train.save_every=3",
            f"weight_sync.transport={transport}",
            *COMMON,
            *SPLIT_FSDP,
        )
        _ray_train(cfg)
        runs[transport] = run
    a, b = _rows(runs["object_store"]), _rows(runs["collective"])
    assert a.keys() == b.keys() == {1, 2, 3}
    for step in a:  # the same samples from the same weights: the same statistics
        for key in ("reward_mean", "kl", "entropy", "response_length_mean"):
            assert a[step][key] == b[step][key], (step, key)
    wa, wb = _weights(runs["object_store"], 3), _weights(runs["collective"], 3)
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
