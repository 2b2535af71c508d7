"""rollout.backend=vllm on a real local Ray cluster: vLLM rollout replicas on a pool of their
own train with async GRPO, and ``weight_sync.transport=collective`` leaves every parameter of
vLLM's model equal to the trainer's (as does the object-store path of the same client).

Skipped unless ``import vllm`` works (``make test-vllm`` sets that environment up).
"""

from __future__ import annotations

import pytest
import torch

from ray_local import ray_local
from relayrl.rollout import GenerationRequest, SamplingParams
from vllm_engines import TOL, build, needs_vllm

pytestmark = [pytest.mark.vllm]


@needs_vllm
def test_grpo_on_ray_with_vllm_replicas_on_their_own_pool(tmp_path):
    """``cluster: ray`` with ``rollout.backend: vllm``: the rollout replica (its own pool, its
    own process) runs vLLM behind the replica interface; async eta 1 steps train, weights
    reach the replica with their versions, and the fresh tokens' behaviour logprobs match the
    trainer's."""
    import json
    import os

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    from helpers import run_config
    from relayrl.cluster.ray_roles import build_ray_roles
    from relayrl.controller.trainer import train

    model, _ = build(tmp_path, "llama")
    cfg = run_config(
        model,
        tmp_path / "run",
        "cluster=ray",
        "rollout.backend=vllm",
        "schedule=async",
        "async.eta=1",
        "train.steps=3",
        "algo.prompts_per_step=2",
        "algo.group_size=2",
        "rollout.max_tokens=4",
        "data.eval_size=2",
        "ray.num_cpus=2",
        "ray.pools={train: {bundles: 1}, gen: {bundles: 1}}",
        "ray.placement={actor: train, reference: train, rollout: gen}",
    )
    if ray.is_initialized():
        ray.shutdown()
    try:
        train(cfg, lambda a, c: build_ray_roles(cfg, a, c))
    finally:
        ray.shutdown()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert max(r["staleness_max"] for r in steps) <= 1
    assert steps[0]["mismatch/tokens"] > 0
    assert all(r["mismatch/max_abs"] < 1e-4 for r in steps)


def _vllm_params(host) -> tuple[dict[str, torch.Tensor], int]:
    """The weights vLLM's model computes with inside Ray replica ``host`` (vLLM's names:
    fused ``qkv_proj`` / ``gate_up_proj``, padded vocabulary rows) and the engine's version,
    read in the replica's process under its engine lock (Ray's ``__ray_call__``). vLLM's CPU
    linear layers pack their weight for oneDNN and drop the parameter (shape ``(0,)``): their
    weight is read back through the packed kernel, ``W = cpu_linear(I_K).T`` (exact in fp32:
    each output is one product ``1 * w`` plus zeros)."""
    import ray

    def read(self):
        def params(worker):
            out = {}
            with torch.no_grad():
                for name, mod in worker.get_model().named_modules():
                    for pname, p in mod.named_parameters(recurse=False):
                        if pname == "weight" and p.numel() == 0:
                            eye = torch.eye(mod.input_size_per_partition, dtype=p.dtype)
                            p = mod.cpu_linear(eye, p, None).T
                        out[f"{name}.{pname}"] = p.detach().clone()
            return out

        with self._cv:
            (state,) = self.engine.llm.collective_rpc(params)
            return state, self.engine.version

    return ray.get(host.__ray_call__.remote(read))


def _as_vllm(hf: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """The HF tensors behind vLLM's Llama parameter ``name`` (q/k/v and gate/up stacked)."""
    for fused, parts in (
        ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
        ("gate_up_proj", ("gate_proj", "up_proj")),
    ):
        if f".{fused}." in name:
            return torch.cat([hf[name.replace(fused, p)] for p in parts])
    return hf[name]


@needs_vllm
def test_collective_weight_sync_into_a_vllm_replica_on_ray(tmp_path):
    """``weight_sync.transport=collective`` into a vLLM rollout replica on Ray (its own pool):
    after one actor update, trainer rank 0 broadcasts the weights in small buckets; every
    parameter of vLLM's model then equals (torch.equal) the trainer's (q/k/v and gate/up
    stacked as vLLM fuses them) at the client's version, and the replica's greedy samples carry
    it. The object-store transport of the same weights into the same replica (the client's
    other path) leaves vLLM's parameters bit for bit as the collective did, and the greedy
    tokens and behaviour logprobs equal; those logprobs equal the trainer's recompute."""
    import os

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    from helpers import run_config
    from relayrl.cluster.ray_roles import build_ray_roles
    from relayrl.controller.algorithms import make_requests
    from relayrl.data.prompts import PromptSource
    from relayrl.workers import Experience

    model, _ = build(tmp_path, "llama")
    cfg = run_config(
        model,
        tmp_path / "run",
        "cluster=ray",
        "rollout.backend=vllm",
        "rollout.vllm_kv_cache_gib=0.0625",
        "weight_sync.transport=collective",
        "model.fsdp.sync_bucket_mb=0.05",  # several buckets
        "algo.prompts_per_step=2",
        "algo.group_size=2",
        "rollout.max_tokens=6",
        "ray.num_cpus=2",
        "ray.pools={train: {bundles: 1}, gen: {bundles: 1}}",
        "ray.placement={actor: train, reference: train, rollout: gen}",
    )
    with ray_local():  # a cluster of this test's own
        roles = build_ray_roles(cfg, str(model), None)
        client = roles.rollout
        try:
            assert client._collective and client.num_replicas == 1
            host = client.replica(0)
            tok = roles.tokenizer
            prompts = PromptSource(cfg.data, tok, 0).for_step(0, 2)
            samples = client.generate(make_requests(prompts, cfg, 0, [tok.eos_token_id]))
            exp = Experience.from_samples(samples, tok.pad_token_id)
            exp.old_logprobs = roles.actor.compute_logprobs(exp)
            exp.advantages = torch.randn(
                exp.response_mask.shape, generator=torch.Generator().manual_seed(0)
            )
            roles.actor.update(exp)
            initial, v0 = _vllm_params(host)
            assert v0 == 0

            client.update_weights(roles.actor.state_dict(), version=1, interrupt=True)
            coll, v1 = _vllm_params(host)
            assert v1 == client.version == 1
            trainer = ray.get(roles.actor.state_dict().ref)
            changed = 0
            for name, got in coll.items():
                want = _as_vllm(trainer, name)
                rows = got[: want.shape[0]]  # vLLM pads the vocabulary to a multiple of 64
                assert rows.shape == want.shape and torch.equal(rows, want), name
                changed += int(not torch.equal(got, initial[name]))
            assert changed > 0  # the update moved weights: the sync carried new values
            greedy = [
                GenerationRequest(
                    s.prompt_ids, SamplingParams(greedy=True, max_tokens=8, ignore_eos=True)
                )
                for s in samples
            ]
            after_coll = client.generate(greedy)
            assert all(s.versions == [1] * 8 for s in after_coll)

            client._collective = False  # the object-store path of the same client and replica
            client.update_weights(roles.actor.state_dict(), version=2, interrupt=True)
            store, v2 = _vllm_params(host)
            assert v2 == client.version == 2
            assert store.keys() == coll.keys()
            assert all(torch.equal(store[k], coll[k]) for k in coll)
            after_store = client.generate(greedy)
            for c, s in zip(after_coll, after_store, strict=True):
                assert s.versions == [2] * 8
                assert c.response_ids == s.response_ids
                assert c.behaviour_logprobs == s.behaviour_logprobs
            exp = Experience.from_samples(after_coll, tok.pad_token_id)
            recompute = roles.actor.compute_logprobs(exp)
            mask = exp.response_mask.bool()
            gap = (exp.behaviour_logprobs - recompute)[mask].abs().max()
            assert gap < TOL, float(gap)
        finally:
            roles.close()
