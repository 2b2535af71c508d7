"""The reward-hacking lab (``relayrl demo rlhf``): InstructGPT's recipe against a known truth.

Steps, each a real relayrl component on a tiny word-level model of the city language
(:mod:`relayrl.data.city_lang`):

1. build a tiny Llama with a word-level tokenizer; SFT it on grammatical sentences;
2. sample two completions per prompt from the SFT policy and label each pair with
   Bradley-Terry noise on the true score, P(a > b) = sigmoid((s_a - s_b) / T), ties coin flips;
3. train a reward model on the pairs (``relayrl rm``); measure held-out agreement with the
   noisy labels against the noise ceiling, accuracy against the truth, and the blind-spot
   probe (words of grammatical sentences shuffled);
4. PPO against the reward model with beta = 0.1 and beta = 0 (``relayrl train``, reward
   ``reward.model_path``), the true score as the gold monitor, logged every step;
5. optionally DPO on the same pairs (the no-RL baseline);
6. evaluate every policy on fresh samples (proxy = RM score, true score, grammatical
   fraction, KL to the SFT policy, distinct responses) and write ``report.md`` with PNG plots
   and ``results.json``.

Expected (asserted by the tests on the checked-in seed 0, and by a slow test on seeds 1-4):
with beta = 0.1 proxy and true score both rise; with beta = 0 the proxy rises higher while
the true score falls below the SFT policy's (reward hacking); diversity falls in both.
The seed-0 figures (RM agreement, final proxy and true scores, KL) are in
docs/measurements.md; with beta = 0 the policy repeats one good word until the length limit,
never finishing the sentence.

Design choices that make the result reliable (each measured): a word-level tokenizer with a
BOS token (short sequences; the BOS is an attention sink, so a small model can count words);
a reward model on its own fresh tiny backbone (initialised from the tiny SFT model it averaged
attribute words instead of counting them, which made its preferences among good sentences a
coin flip); every PPO/DPO setting the result depends on pinned in ``PINNED_PPO`` /
``PINNED_DPO`` rather than taken from ``RunConfig`` defaults.
"""

from __future__ import annotations

import functools
import json
import math
import shutil
import time
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from relayrl.config import RunConfig, SFTConfig, load_config
from relayrl.controller.rm_training import RMConfig, train_reward_model
from relayrl.data import city_lang as cl
from relayrl.data import write_jsonl
from relayrl.data.preferences import write_preferences
from relayrl.labs.measures import (
    evaluate_policy,
    lab_prompts,
    label_pairs,
    probe_blind_spot,
    rm_agreement,
    sample_completions,
)
from relayrl.labs.report import clean_zero
from relayrl.labs.word_model import build_word_model
from relayrl.model import load_causal_lm, load_tokenizer
from relayrl.reward.service.rm_scorer import RewardModelScorer
from relayrl.telemetry import read_metrics

__all__ = ["GOLD_FN", "LabConfig", "hacking_verdict", "main_lab", "run_lab"]

GOLD_FN = "relayrl.data.city_lang:true_score_reward"


class LabConfig(BaseModel):
    """Every knob of the lab; the defaults are the checked-in, measured setting."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    seed: int = 0
    run_dir: str = "runs/demo/rlhf"
    threads: int = Field(1, ge=1)
    # tiny policy / reward-model backbone
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    # 1. SFT on the language
    sft_examples: int = 20000
    sft_steps: int = 800
    sft_batch_size: int = 64
    sft_lr: float = 3e-3
    # 2. preference pairs sampled from the SFT policy
    train_pairs: int = 6000
    eval_pairs: int = 600
    label_temperature: float = Field(1.0, gt=0)
    # 3. reward model: its own tiny backbone (``rm_init: scratch``) or the SFT model's
    rm_init: Literal["scratch", "sft"] = "scratch"
    rm_hidden_size: int = 32
    rm_num_layers: int = 2
    rm_num_heads: int = 2
    rm_epochs: float = 3.0
    rm_batch_size: int = 32
    rm_lr: float = 3e-3
    probe_sentences: int = 500
    # 4. PPO against the reward model
    betas: list[float] = Field(default_factory=lambda: [0.1, 0.0])
    ppo_steps: int = 80
    ppo_prompts_per_step: int = 64
    ppo_lr: float = 1e-3
    ppo_critic_lr: float = 2e-3
    ppo_epochs: int = 1
    ppo_mini_batches: int = 2
    max_tokens: int = 10
    # 5. DPO baseline
    dpo: bool = True
    dpo_steps: int = 100
    dpo_beta: float = 0.5
    dpo_lr: float = 5e-4
    # 6. evaluation and report
    eval_samples: int = 256
    plots: bool = True
    progress: bool = True


# ---------------------------------------------------------------------------- pipeline


# Every setting the lab's result depends on is pinned here, not left to RunConfig defaults:
# the checked-in seed must keep giving the measured result when a default changes.
PINNED_PPO = [
    "schedule=sync",
    "algo.advantage=gae",
    "algo.policy_loss=ppo",
    "algo.loss_agg=token-mean",
    "algo.micro_batch_size=64",
    "algo.clip_eps_low=0.2",
    "algo.clip_eps_high=0.2",
    "algo.kl_estimator=k1",
    "algo.entropy_coef=0.0",
    "algo.gamma=1.0",
    "algo.lam=0.95",
    "algo.whiten_advantages=true",
    "algo.vf_coef=0.5",
    "algo.vf_clip=0.2",
    "optim.weight_decay=0.0",
    "optim.betas=[0.9, 0.99]",
    "optim.warmup_steps=0",
    "optim.grad_clip=1.0",
    "rollout.temperature=1.0",
    "rollout.top_p=1.0",
    "rollout.top_k=0",
]
PINNED_DPO = [
    "algo.micro_batch_size=64",
    "optim.weight_decay=0.0",
    "optim.betas=[0.9, 0.99]",
    "optim.warmup_steps=10",
    "optim.grad_clip=1.0",
]


def _ppo_config(cfg: LabConfig, root: Path, beta: float, sft: Path, rm: Path) -> RunConfig:
    name = f"ppo_beta{beta:g}"
    return load_config(
        RunConfig,
        None,
        [
            *PINNED_PPO,
            f"seed={cfg.seed}",
            f"run_dir={root / name}",
            f"threads={cfg.threads}",
            f"model.path={sft}",
            "data.task=jsonl",
            f"data.train_path={root / 'data' / 'prompts.jsonl'}",
            f"data.eval_path={root / 'data' / 'prompts.jsonl'}",
            "reward.fn=none",
            f"reward.model_path={rm}",
            f"monitor.gold_fn={GOLD_FN}",
            "algo.name=ppo",
            f"algo.kl_coef={beta}",
            "algo.group_size=1",
            f"algo.prompts_per_step={cfg.ppo_prompts_per_step}",
            f"algo.epochs={cfg.ppo_epochs}",
            f"algo.mini_batches={cfg.ppo_mini_batches}",
            f"optim.lr={cfg.ppo_lr}",
            f"optim.critic_lr={cfg.ppo_critic_lr}",
            f"rollout.max_tokens={cfg.max_tokens}",
            f"train.steps={cfg.ppo_steps}",
            "train.keep_checkpoints=1",
            "logging.tensorboard=false",
            f"logging.progress={str(cfg.progress).lower()}",
        ],
    )


def _dpo_config(cfg: LabConfig, root: Path, sft: Path) -> RunConfig:
    return load_config(
        RunConfig,
        None,
        [
            *PINNED_DPO,
            f"seed={cfg.seed}",
            f"run_dir={root / 'dpo'}",
            f"threads={cfg.threads}",
            f"model.path={sft}",
            "data.task=jsonl",
            f"data.train_path={root / 'data' / 'pairs_train.jsonl'}",
            f"data.eval_path={root / 'data' / 'pairs_eval.jsonl'}",
            "algo.name=dpo",
            f"algo.kl_coef={cfg.dpo_beta}",
            "algo.prompts_per_step=64",
            f"optim.lr={cfg.dpo_lr}",
            f"train.steps={cfg.dpo_steps}",
            "train.keep_checkpoints=1",
            "logging.tensorboard=false",
            f"logging.progress={str(cfg.progress).lower()}",
        ],
    )


def run_lab(cfg: LabConfig, log: Any = print) -> dict[str, Any]:
    """Run the whole lab under ``cfg.run_dir``; return (and write) ``results.json``."""
    from relayrl.cluster.local import build_local_roles
    from relayrl.controller.checkpoint import latest_checkpoint
    from relayrl.controller.dpo import train_dpo
    from relayrl.controller.sft import run_sft
    from relayrl.controller.trainer import train
    from relayrl.labs.report import write_report

    torch.set_num_threads(cfg.threads)
    t_start = time.perf_counter()
    root = Path(cfg.run_dir)
    data_dir = root / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    results: dict[str, Any] = {"config": cfg.model_dump()}

    # 1. the language, a tiny model, SFT
    t0 = time.perf_counter()
    lang = cl.CityLanguage(seed=cfg.seed)
    write_jsonl(
        data_dir / "sft.jsonl",
        ({"prompt": p, "response": c} for p, c in lang.sample_many(cfg.sft_examples)),
    )
    write_jsonl(
        data_dir / "prompts.jsonl", ({"prompt": cl.CityLanguage.prompt(c)} for c in cl.CITIES)
    )
    base = build_word_model(
        root / "base", cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.seed
    )
    sft_dir = root / "sft"
    log("1/5 SFT on the city language ...")
    sft_out = run_sft(
        SFTConfig(
            seed=cfg.seed,
            threads=cfg.threads,
            model_path=str(base),
            output_dir=str(sft_dir),
            task="jsonl",
            train_path=str(data_dir / "sft.jsonl"),
            steps=cfg.sft_steps,
            batch_size=cfg.sft_batch_size,
            lr=cfg.sft_lr,
            warmup_steps=20,
            weight_decay=0.0,
            grad_clip=1.0,
            progress=cfg.progress,
        )
    )
    timings["sft_s"] = time.perf_counter() - t0
    results["sft"] = {"loss": sft_out["sft/loss"]}

    # 2. preference pairs from the SFT policy, Bradley-Terry labels on the true score
    t0 = time.perf_counter()
    log("2/5 sampling preference pairs from the SFT policy ...")
    sft_model = load_causal_lm(sft_dir).eval()
    tokenizer = load_tokenizer(sft_dir)
    n_total = int(1.15 * (cfg.train_pairs + cfg.eval_pairs)) + 16  # room for dropped pairs
    prompts = lab_prompts(n_total, cfg.seed + 1)
    first, *_ = sample_completions(sft_model, tokenizer, prompts, cfg.max_tokens, cfg.seed + 2)
    second, *_ = sample_completions(sft_model, tokenizer, prompts, cfg.max_tokens, cfg.seed + 3)
    pairs, dropped = label_pairs(prompts, first, second, cfg.seed + 4, cfg.label_temperature)
    train_pairs = pairs[: cfg.train_pairs]
    eval_pairs = pairs[cfg.train_pairs : cfg.train_pairs + cfg.eval_pairs]
    write_preferences(data_dir / "pairs_train.jsonl", train_pairs)
    write_preferences(data_dir / "pairs_eval.jsonl", eval_pairs)
    results["pairs"] = {
        "train": len(train_pairs),
        "eval": len(eval_pairs),
        "dropped_identical": dropped,
    }
    timings["pairs_s"] = time.perf_counter() - t0

    # 3. reward model
    t0 = time.perf_counter()
    log("3/5 training the reward model (Bradley-Terry) ...")
    rm_dir = root / "rm"
    # A fresh backbone learns to count attribute words; one initialised from the tiny SFT
    # model tends to average them (measured), a weaker and noisier proxy.
    rm_base = sft_dir
    if cfg.rm_init == "scratch":
        rm_base = build_word_model(
            root / "rm_base",
            cfg.rm_hidden_size,
            cfg.rm_num_layers,
            cfg.rm_num_heads,
            cfg.rm_num_heads,
            cfg.seed + 7,
        )
    rm_out = train_reward_model(
        RMConfig(
            seed=cfg.seed,
            threads=cfg.threads,
            model_path=str(rm_base),
            output_dir=str(rm_dir),
            train_path=str(data_dir / "pairs_train.jsonl"),
            eval_path=str(data_dir / "pairs_eval.jsonl"),
            epochs=cfg.rm_epochs,
            batch_size=cfg.rm_batch_size,
            lr=cfg.rm_lr,
            progress=cfg.progress,
        ),
        log=log,
    )
    scorer = RewardModelScorer(rm_dir)
    results["rm"] = {
        "eval_accuracy": rm_out["eval_accuracy"],
        "train_accuracy": rm_out["train_accuracy"],
        **rm_agreement(scorer, eval_pairs, cfg.label_temperature),
    }
    results["blind_spot"] = probe_blind_spot(scorer, cfg.probe_sentences, cfg.seed)
    timings["rm_s"] = time.perf_counter() - t0

    # 4. PPO against the reward model, one run per beta; the true score is the gold monitor
    eval_prompts = lab_prompts(cfg.eval_samples, cfg.seed + 99)
    results["runs"] = {}
    results["curves"] = {}
    reference = sft_model
    results["runs"]["sft"] = evaluate_policy(
        sft_dir, reference, scorer, eval_prompts, cfg.max_tokens, cfg.seed + 5
    )
    for beta in cfg.betas:
        t0 = time.perf_counter()
        log(f"4/5 PPO against the reward model, beta = {beta:g} ...")
        rl_cfg = _ppo_config(cfg, root, beta, sft_dir, rm_dir)
        shutil.rmtree(rl_cfg.run_dir, ignore_errors=True)  # no stale checkpoints of a rerun
        train(rl_cfg, functools.partial(build_local_roles, rl_cfg))
        ckpt = latest_checkpoint(rl_cfg.run_dir)
        assert ckpt is not None
        name = f"ppo_beta{beta:g}"
        results["runs"][name] = evaluate_policy(
            ckpt / "actor", reference, scorer, eval_prompts, cfg.max_tokens, cfg.seed + 5
        )
        results["runs"][name]["beta"] = beta
        results["curves"][name] = _curves(read_metrics(rl_cfg.run_dir))
        timings[f"{name}_s"] = time.perf_counter() - t0

    # 5. DPO on the same pairs
    if cfg.dpo:
        t0 = time.perf_counter()
        log("5/5 DPO on the same preference pairs ...")
        dpo_cfg = _dpo_config(cfg, root, sft_dir)
        shutil.rmtree(dpo_cfg.run_dir, ignore_errors=True)
        dpo_out = train_dpo(dpo_cfg)
        ckpt = latest_checkpoint(dpo_cfg.run_dir)
        assert ckpt is not None
        results["runs"]["dpo"] = evaluate_policy(
            ckpt / "actor", reference, scorer, eval_prompts, cfg.max_tokens, cfg.seed + 5
        )
        results["runs"]["dpo"]["held_out_accuracy"] = dpo_out.get("eval_after")
        timings["dpo_s"] = time.perf_counter() - t0

    timings["total_s"] = time.perf_counter() - t_start
    results["timings"] = timings
    results["hacking"] = hacking_verdict(results["runs"])
    (root / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    write_report(root, results, plots=cfg.plots)
    return results


def _curves(history: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Per-step series of a run's metrics.jsonl for the report."""
    keys = {
        "proxy": "reward_mean",
        "true": "monitor/gold",
        "grammatical": "monitor/gold_grammatical",
        "kl": "monitor/kl_seq",
        "distinct": "monitor/distinct_frac",
        "distinct_2": "monitor/distinct_2",
        "divergence": "monitor/divergence",
    }
    out: dict[str, list[float]] = {k: [] for k in keys}
    out["step"] = []
    for rec in history:
        if "reward_mean" not in rec:
            continue  # eval records
        out["step"].append(float(rec["step"]))
        for k, key in keys.items():
            v = rec.get(key, math.nan)
            out[k].append(float(v) if v is not None else math.nan)
    return out


def hacking_verdict(runs: dict[str, Any]) -> dict[str, Any]:
    """The two qualitative results, checked on the final evaluations against the SFT policy:
    beta = 0.1 raises proxy and true score; beta = 0 raises the proxy higher while the true
    score falls; diversity (distinct-2) falls in both."""
    sft, kl, nokl = runs.get("sft"), runs.get("ppo_beta0.1"), runs.get("ppo_beta0")
    if not (sft and kl and nokl):
        return {}
    return {
        "kl_run_proxy_up": kl["proxy"] > sft["proxy"],
        "kl_run_true_up": kl["true"] > sft["true"],
        "nokl_proxy_higher": nokl["proxy"] > kl["proxy"],
        "nokl_true_down": nokl["true"] < sft["true"],
        # distinct-2 rather than distinct strings: a hacked policy's word salad of two good
        # words can be many different strings while its n-gram diversity collapses
        "diversity_down_both": kl["distinct_2"] < sft["distinct_2"]
        and nokl["distinct_2"] < sft["distinct_2"],
    }


def main_lab(run_dir: str | Path, overrides: list[str] | None = None) -> dict[str, Any]:
    """``relayrl demo rlhf``: the lab with ``key=value`` overrides of ``LabConfig``."""
    cfg = load_config(LabConfig, None, [f"run_dir={run_dir}", *(overrides or [])])
    results = run_lab(cfg)
    runs = results["runs"]
    print(f"\nreport: {Path(cfg.run_dir) / 'report.md'}")
    print(
        f"reward model: held-out agreement {results['rm']['label_agreement']:.3f} "
        f"(noise ceiling {results['rm']['noise_ceiling']:.3f}), "
        f"truth accuracy {results['rm']['truth_accuracy']:.3f}"
    )
    for name, r in runs.items():
        print(
            f"{name:>14}: proxy {r['proxy']:+.2f}  true {r['true']:+.2f}  "
            f"grammatical {r['grammatical']:.2f}  KL {clean_zero(r['kl']):.2f}  "
            f"distinct {r['distinct_responses']}/{r['n']}"
        )
    return results
