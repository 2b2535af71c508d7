"""SFT model -> reward model (``relayrl rm``'s ``train_reward_model``) -> PPO against it, on a
tiny model and synthetic pairs (chosen: a number, rejected: letters): the reward model's
held-out figures are its Bradley-Terry loss and pairwise accuracy recomputed by hand from its
scores; the PPO run scores every completion with that model, (r - mean) / std with the
statistics it saved. (That PPO learns against a trained reward model, its proxy score rising,
is the RLHF lab's: ``test_rlhf_lab.py::test_lab_reproduces_reward_hacking``; here the tiny
reward model scores nearly every completion as "chosen", too easy a reward to show it.)"""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

import relayrl.controller.algorithms as algorithms
from helpers import run_config
from relayrl.cluster.local import build_local_roles
from relayrl.controller.rm_training import RMConfig, train_reward_model
from relayrl.controller.trainer import train
from relayrl.model import build_tiny_model, load_tokenizer
from relayrl.model.reward_model import load_reward_model, score_texts


def _pairs(rng: random.Random, n: int) -> list[dict]:
    out = []
    for _ in range(n):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        letters = "".join(rng.choice("xyzw") for _ in range(3))
        out.append(
            {"prompt": f"{a}+{b}=", "chosen": str(rng.randint(10, 999)), "rejected": letters}
        )
    return out


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    root = tmp_path_factory.mktemp("rlhf")
    sft = build_tiny_model(root / "sft", hidden_size=32, seed=1)
    rng = random.Random(0)
    data = {"train": _pairs(rng, 200), "eval": _pairs(rng, 50)}
    for name, rows in data.items():
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = RMConfig(
        model_path=str(sft),
        output_dir=str(root / "rm"),
        train_path=str(root / "train.jsonl"),
        eval_path=str(root / "eval.jsonl"),
        steps=60,
        batch_size=16,
        lr=3e-3,
        progress=False,
        threads=1,
    )
    result = train_reward_model(cfg, log=lambda *a: None)
    return root, sft, data, result


def test_reward_model_reports_bradley_terry_loss_and_held_out_accuracy(pipeline):
    root, _, data, result = pipeline
    saved = json.loads((root / "rm" / "relayrl_rm.json").read_text())
    assert saved["eval_pairs"] == 50 and saved["train_pairs"] == 200
    tok = load_tokenizer(root / "rm")
    rm = load_reward_model(root / "rm", pad_token_id=tok.pad_token_id)
    held = data["eval"]
    prompts = [p["prompt"] for p in held]
    rc = score_texts(rm, tok, prompts, [p["chosen"] for p in held]).tolist()
    rr = score_texts(rm, tok, prompts, [p["rejected"] for p in held]).tolist()
    # -log sigmoid(d) = log(1 + exp(-d)); accuracy: d > 0 (ties 1/2)
    loss = sum(math.log1p(math.exp(-(c - r))) for c, r in zip(rc, rr, strict=True)) / len(held)
    acc = sum(1.0 if c > r else 0.5 if c == r else 0.0 for c, r in zip(rc, rr, strict=True))
    assert saved["eval_loss"] == pytest.approx(loss, rel=1e-4, abs=1e-6)
    assert saved["eval_accuracy"] == pytest.approx(acc / len(held))
    assert saved["eval_accuracy"] > 0.9  # measured 1.0: the task is easy
    assert result["eval_accuracy"] == saved["eval_accuracy"]


def test_ppo_scores_with_the_trained_reward_model(pipeline, tmp_path, monkeypatch):
    root, sft, _, _ = pipeline
    cfg = run_config(
        sft,
        tmp_path / "ppo",
        "algo.name=ppo",
        "algo.group_size=1",
        "algo.prompts_per_step=8",
        "algo.kl_coef=0.01",
        "rollout.max_tokens=4",
        "data.eval_size=2",
        "train.steps=15",
        "train.save_every=0",
        "reward.fn=none",
        f"reward.model_path={root / 'rm'}",
        "optim.lr=5e-3",
    )
    steps = []
    ppo_step = algorithms.ppo_step

    def recording(roles, cfg, schedule, step, kl_ctl):
        exp, stats = ppo_step(roles, cfg, schedule, step, kl_ctl)
        steps.append(exp)
        return exp, stats

    monkeypatch.setattr(algorithms, "ppo_step", recording)
    train(cfg, lambda a, c: build_local_roles(cfg, a, c))
    saved = json.loads((root / "rm" / "relayrl_rm.json").read_text())
    tok = load_tokenizer(root / "rm")
    rm = load_reward_model(root / "rm", pad_token_id=tok.pad_token_id)
    for exp in (steps[0], steps[-1]):
        prompts = [s.metadata["prompt"] for s in exp.samples]
        texts = [tok.decode(s.response_ids, skip_special_tokens=True) for s in exp.samples]
        r = score_texts(rm, tok, prompts, texts)
        want = (r - saved["reward_mean"]) / saved["reward_std"]
        assert torch.allclose(exp.scores.float(), want.float(), atol=1e-4)
    assert len(steps) == 15 and all(len(exp) == 8 for exp in steps)


def test_a_critic_from_the_reward_model_keeps_its_head(pipeline):
    """``model.critic_path: <the reward model>`` (InstructGPT initialises the value function
    from the RM): the critic is the RM's backbone and its scalar head, rescaled to the score
    PPO gets, so V at a sequence's last token = (r - mean) / std; the head was zeroed before
    (the RM's backbone under a value of 0 everywhere)."""
    from relayrl.model import load_critic

    root, _, data, _ = pipeline
    saved = json.loads((root / "rm" / "relayrl_rm.json").read_text())
    tok = load_tokenizer(root / "rm")
    rm = load_reward_model(root / "rm", pad_token_id=tok.pad_token_id)
    critic = load_critic(root / "rm")
    pairs = data["eval"][:4]
    prompts = [p["prompt"] for p in pairs]
    texts = [p["chosen"] for p in pairs]
    r = score_texts(rm, tok, prompts, texts)
    for i, (p, c) in enumerate(zip(prompts, texts, strict=True)):
        ids = tok(p).input_ids + tok(c, add_special_tokens=False).input_ids
        with torch.no_grad():
            v = critic(input_ids=torch.tensor([ids])).logits[0, -1, 0]
        want = (float(r[i]) - saved["reward_mean"]) / saved["reward_std"]
        assert float(v) == pytest.approx(want, abs=1e-4)
    assert abs(want) > 0.1  # a trained head, not the zero one


def test_a_critic_from_a_causal_lm_starts_at_zero(pipeline):
    from relayrl.model import load_critic

    _, sft, _, _ = pipeline
    critic = load_critic(sft)
    with torch.no_grad():
        assert not critic(input_ids=torch.tensor([[1, 2, 3]])).logits.any()
