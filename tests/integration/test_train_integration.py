"""End to end on a tiny model: GRPO and PPO raise the held-out pass rate; rollout logprobs match
the trainer's; checkpoints load with plain transformers; resume is exact."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers import run_config
from relayrl.cluster.local import build_local_roles
from relayrl.controller.algorithms import make_requests
from relayrl.controller.checkpoint import latest_checkpoint
from relayrl.controller.trainer import train
from relayrl.data.prompts import PromptSource
from relayrl.workers import Experience


def _train(cfg, resume=False):
    return train(cfg, lambda a, c: build_local_roles(cfg, a, c), resume=resume)


@pytest.mark.learning
def test_grpo_raises_held_out_pass_rate(sft_model, tmp_path, outcome):
    """Held-out gain of 60 GRPO steps, measured over seeds 0-4 (min / median): 0.155 / 0.175
    (from 0.305-0.41); seed 0 with other CPU kernels, one busy process beside the suite:
    0.12 (avx2), 0.095 (default). A clear rise, at about half the worst run's."""
    cfg = run_config(sft_model, tmp_path / "grpo", "train.steps=60", "data.eval_size=200")
    out = _train(cfg)
    outcome(before=out["eval_before"], after=out["eval_after"])
    assert out["eval_after"] >= out["eval_before"] + 0.05, out
    lines = (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()
    rec = json.loads(lines[1])
    for key in (
        "reward_mean",
        "pass_rate",
        "kl",
        "entropy",
        "clipfrac",
        "response_length_mean",
        "response_length_max",
        "gen_tokens_per_s",
        "train_tokens_per_s",
        "time/generate",
        "time/score",
        "time/train",
    ):
        assert key in rec, key


@pytest.mark.learning
def test_ppo_raises_held_out_pass_rate(sft_model, tmp_path, outcome):
    """Held-out gain of 60 PPO steps (critic, GAE, KL 0.01), measured over seeds 0-4
    (min / median): 0.12 / 0.27; seed 0 with other CPU kernels under load: 0.15 (avx2), 0.055
    (default; 0.10 at lr 3e-4 or at 80 steps)."""
    cfg = run_config(
        sft_model,
        tmp_path / "ppo",
        "algo.name=ppo",
        "algo.kl_coef=0.01",
        "train.steps=60",
        "data.eval_size=200",
    )
    out = _train(cfg)
    outcome(before=out["eval_before"], after=out["eval_after"])
    assert out["eval_after"] >= out["eval_before"] + 0.03, out
    assert "critic/vf_loss" in out and out["kl_beta"] == pytest.approx(0.01)
    assert (tmp_path / "ppo" / "checkpoints" / "step_000060" / "critic" / "config.json").is_file()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_rollout_logprobs_equal_trainer_logprobs(sft_model, tmp_path, temperature):
    cfg = run_config(
        sft_model, tmp_path / "lp", f"rollout.temperature={temperature}", "algo.prompts_per_step=8"
    )
    roles = build_local_roles(cfg, str(sft_model), None)
    prompts = PromptSource(cfg.data, roles.tokenizer, cfg.seed).for_step(0, 8)
    samples = roles.rollout.generate(make_requests(prompts, cfg, 0, [roles.tokenizer.eos_token_id]))
    exp = Experience.from_samples(samples, roles.tokenizer.pad_token_id)
    recomputed = roles.actor.compute_logprobs(exp)
    # the engine's and the trainer's fp32 logits differ by float rounding (different GEMMs);
    # dividing by the temperature scales that difference by 1 / T in the logprobs
    torch.testing.assert_close(recomputed, exp.behaviour_logprobs, atol=1e-5 / temperature, rtol=0)
    assert exp.response_mask.sum() > len(samples)  # real multi-token responses


def test_checkpoint_loads_with_plain_transformers(sft_model, tmp_path):
    cfg = run_config(
        sft_model,
        tmp_path / "ck",
        "train.steps=2",
        "algo.prompts_per_step=4",
        "algo.group_size=2",
        "data.eval_size=4",
    )
    _train(cfg)
    ckpt = latest_checkpoint(tmp_path / "ck")
    assert ckpt is not None and ckpt.name == "step_000002"
    model = AutoModelForCausalLM.from_pretrained(ckpt / "actor", local_files_only=True)
    assert model.config.model_type == "llama"
    assert not list((tmp_path / "ck" / "checkpoints").glob(".tmp*"))


DETERMINISTIC = (
    "reward_mean",
    "pass_rate",
    "actor/loss",
    "actor/kl",
    "actor/entropy",
    "actor/clipfrac",
    "actor/grad_norm",
    "response_length_mean",
    "critic/vf_loss",
)


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_resume_is_exact(sft_model, tmp_path, algo):
    """2N steps straight == N steps, stop, resume for N more (same seed, sync mode)."""
    common = [
        "algo.prompts_per_step=8",
        "algo.group_size=4",
        "data.eval_size=8",
        f"algo.name={algo}",
        "algo.kl_coef=0.05",
        "train.save_every=2",
    ]
    straight = run_config(sft_model, tmp_path / "a", "train.steps=4", *common)
    _train(straight)
    first = run_config(sft_model, tmp_path / "b", "train.steps=2", *common)
    _train(first)
    second = run_config(sft_model, tmp_path / "b", "train.steps=4", *common)
    _train(second, resume=True)

    def metrics(run):
        rows = [json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        return {
            r["step"]: {k: r[k] for k in DETERMINISTIC if k in r}
            for r in rows
            if "reward_mean" in r
        }

    ma, mb = metrics("a"), metrics("b")
    assert sorted(ma) == sorted(mb) == [1, 2, 3, 4]
    assert ma == mb
    wa = AutoModelForCausalLM.from_pretrained(
        tmp_path / "a/checkpoints/step_000004/actor"
    ).state_dict()
    wb = AutoModelForCausalLM.from_pretrained(
        tmp_path / "b/checkpoints/step_000004/actor"
    ).state_dict()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def test_interrupted_save_keeps_earlier_checkpoints(sft_model, tmp_path, monkeypatch):
    """A crash in the middle of writing checkpoint N leaves checkpoint N-1 complete and latest."""
    from relayrl.controller import checkpoint as ck

    cfg = run_config(
        sft_model,
        tmp_path / "crash",
        "train.steps=2",
        "train.save_every=1",
        "algo.prompts_per_step=4",
        "algo.group_size=2",
        "data.eval_size=4",
    )
    real_save = ck.torch.save
    calls = {"n": 0}

    def exploding_save(obj, path, *a, **k):
        calls["n"] += 1
        if calls["n"] == 2:  # the second checkpoint dies half-written
            raise KeyboardInterrupt("simulated kill during save")
        return real_save(obj, path, *a, **k)

    monkeypatch.setattr(ck.torch, "save", exploding_save)
    with pytest.raises(KeyboardInterrupt):
        _train(cfg)
    ckpt = latest_checkpoint(tmp_path / "crash")
    assert ckpt is not None and ckpt.name == "step_000001"
    AutoModelForCausalLM.from_pretrained(ckpt / "actor", local_files_only=True)
    monkeypatch.setattr(ck.torch, "save", real_save)
    out = _train(cfg, resume=True)  # resumes from step 1 and finishes
    assert latest_checkpoint(tmp_path / "crash").name == "step_000002"
    assert out["eval_after"] is not None
