"""Reward-model training (``relayrl rm``): Bradley-Terry on preference pairs.

The reward model (``relayrl.model.reward_model``) is an LM backbone plus a scalar head read
at the last non-pad token, saved in Hugging Face format.

Loss (Bradley-Terry, as in InstructGPT, Ouyang et al. 2022; ``algos.preference_loss``):

    L = -mean_i log sigmoid(r(x_i, y_i^chosen) - r(x_i, y_i^rejected))

Held-out pairwise accuracy = mean_i [r_chosen > r_rejected] (a tie counts 1/2).

Next to the weights, ``relayrl_rm.json`` records the held-out figures and the mean and std
of the reward over the training completions; ``RewardModelScorer`` uses them to normalise
scores to mean 0, std 1 on the data the model was trained on (InstructGPT normalises its RM
so that reference completions score 0 on average).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from relayrl.algos.preference_loss import bradley_terry_loss
from relayrl.config import Threads
from relayrl.controller.run_dir import output_dir_locked
from relayrl.data.preferences import PreferencePair, load_preferences, split_pairs
from relayrl.model import (
    load_tokenizer,
    save_model_atomic,
    set_threads,
)
from relayrl.model.reward_model import (
    DTYPES,
    RM_STATS_FILE,
    encode,
    load_reward_model,
    reward_forward,
    score_texts,
)
from relayrl.telemetry import MetricsLogger, StepProgress
from relayrl.workers.optim import make_optimizer

__all__ = ["RMConfig", "evaluate_pairs", "train_reward_model"]


class RMConfig(BaseModel):
    """``relayrl rm CONFIG``: train a reward model on preference pairs."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    seed: int = 0
    threads: Threads = "auto"
    model_path: str = "runs/demo/sft"
    """Backbone: a causal LM directory (new zero-initialised head) or a reward model."""
    output_dir: str = "runs/rm"
    train_path: str = "data/preferences.jsonl"
    """JSONL or local Hugging Face dataset with ``prompt``, ``chosen``, ``rejected``."""
    eval_path: str | None = None
    """Held-out pairs; when unset, ``eval_fraction`` of ``train_path`` is held out, by prompt
    (a prompt's pairs all on one side: ``relayrl.data.preferences.split_pairs``)."""
    eval_fraction: float = Field(0.1, ge=0, lt=1)
    epochs: float = Field(2.0, gt=0)
    steps: int | None = Field(None, ge=0)
    """Optimizer steps; overrides ``epochs`` when set."""
    batch_size: int = Field(32, ge=1)
    micro_batch_size: int = Field(64, ge=1)
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = 0.0
    warmup_steps: int = Field(10, ge=0)
    grad_clip: float | None = 1.0
    max_length: int = Field(512, ge=2)
    """Longer prompt+completion inputs keep their last ``max_length`` tokens (counted)."""
    dtype: Literal["float32", "bfloat16", "float64"] = "float32"
    progress: bool = True
    tensorboard: bool = False


def evaluate_pairs(
    model: torch.nn.Module,
    tokenizer: Any,
    pairs: Sequence[PreferencePair],
    batch_size: int = 64,
    max_length: int = 512,
) -> dict[str, float]:
    """Held-out pairwise accuracy, Bradley-Terry loss and mean margin on ``pairs``."""
    if not pairs:
        return {"accuracy": float("nan"), "loss": float("nan"), "margin": float("nan"), "n": 0.0}
    prompts = [p.prompt for p in pairs]
    rc = score_texts(model, tokenizer, prompts, [p.chosen for p in pairs], batch_size, max_length)
    rr = score_texts(model, tokenizer, prompts, [p.rejected for p in pairs], batch_size, max_length)
    loss, stats = bradley_terry_loss(rc, rr)
    return {
        "accuracy": stats["accuracy"],
        "loss": float(loss),
        "margin": stats["margin"],
        "n": float(len(pairs)),
    }


def train_reward_model(cfg: RMConfig, log: Any = print) -> dict[str, Any]:
    """Train with the Bradley-Terry loss, evaluate on held-out pairs, save to ``output_dir``.

    The model is saved as ``relayrl sft``'s is (``save_model_atomic``: the old ``output_dir`` or
    the new one, never half of one); what a run SIGKILLed in that save left is completed
    first, as soon as the lock is taken (``output_dir_locked``, which runs
    ``finish_interrupted_save``: its new model put in place), before anything can fail.

    ``output_dir`` is locked for the whole run as ``relayrl sft``'s is
    (``relayrl.controller.run_dir.output_dir_locked``: ``.<name>.lock`` beside it): a second
    ``relayrl rm`` on it is refused in one line naming the holder. The per-step curves
    (``metrics.jsonl``, TensorBoard when enabled) are written into the new directory before
    it is swapped in: the model and its curves land together.

    Returns the figures written to ``relayrl_rm.json`` (``eval_accuracy``, ``eval_loss``,
    ``train_pairs``, ``skipped``, ``reward_mean``, ``reward_std``, ...).
    """
    with output_dir_locked(cfg.output_dir) as recovered:
        for line in recovered:  # a save killed mid-way: completed
            log(line)
        return _train(cfg, log)


def _train(cfg: RMConfig, log: Any) -> dict[str, Any]:
    set_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    data = load_preferences(cfg.train_path)
    if data.skipped:
        log(data.skip_summary())
    skipped = dict(data.skipped)
    if cfg.eval_path is not None:
        held = load_preferences(cfg.eval_path)
        if held.skipped:
            log(held.skip_summary())
        train_pairs, eval_pairs = list(data.pairs), held.pairs
    else:
        train_pairs, eval_pairs = split_pairs(data.pairs, cfg.eval_fraction, cfg.seed)
    tokenizer = load_tokenizer(cfg.model_path)
    model = load_reward_model(cfg.model_path, DTYPES[cfg.dtype], tokenizer.pad_token_id)
    opt, sched = make_optimizer(
        list(model.parameters()), cfg.lr, cfg.weight_decay, (0.9, 0.99), cfg.warmup_steps
    )
    per_epoch = math.ceil(len(train_pairs) / cfg.batch_size)
    steps = cfg.steps if cfg.steps is not None else max(1, round(cfg.epochs * per_epoch))
    rng = random.Random(cfg.seed)
    order: list[int] = []
    history: list[dict[str, float]] = []
    truncated = 0
    stats: dict[str, float] = {}
    model.train()
    with StepProgress(steps, "rm", enabled=cfg.progress) as bar:
        for step in range(steps):
            if len(order) < cfg.batch_size:  # refill with a fresh seeded permutation
                perm = list(range(len(train_pairs)))
                rng.shuffle(perm)
                order += perm
            idx, order = order[: cfg.batch_size], order[cfg.batch_size :]
            batch = [train_pairs[i] for i in idx]
            opt.zero_grad(set_to_none=True)
            sums = {"loss": 0.0, "accuracy": 0.0, "margin": 0.0}
            for s in range(0, len(batch), cfg.micro_batch_size):
                micro = batch[s : s + cfg.micro_batch_size]
                prompts = [p.prompt for p in micro] * 2
                texts = [p.chosen for p in micro] + [p.rejected for p in micro]
                enc = encode(tokenizer, prompts, texts, cfg.max_length)
                truncated += enc.truncated
                r = reward_forward(model, enc)
                loss, st = bradley_terry_loss(r[: len(micro)], r[len(micro) :])
                # micro-batch means weighted by their share: the step loss is the batch mean
                (loss * len(micro) / len(batch)).backward()
                sums["loss"] += float(loss.detach()) * len(micro) / len(batch)
                for k in ("accuracy", "margin"):
                    sums[k] += st[k] * len(micro) / len(batch)
            if cfg.grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            sched.step()
            stats = {f"rm/train_{k}": v for k, v in sums.items()}
            history.append(stats)
            bar.update(step + 1, loss=sums["loss"], acc=sums["accuracy"])
    held_out = evaluate_pairs(model, tokenizer, eval_pairs, cfg.micro_batch_size, cfg.max_length)
    train_eval = evaluate_pairs(
        model, tokenizer, train_pairs[:2000], cfg.micro_batch_size, cfg.max_length
    )
    # Reward statistics over the training completions, for normalisation at scoring time.
    sample = train_pairs[:2000]
    r_all = score_texts(
        model,
        tokenizer,
        [p.prompt for p in sample] * 2,
        [p.chosen for p in sample] + [p.rejected for p in sample],
        cfg.micro_batch_size,
        cfg.max_length,
    )
    result: dict[str, Any] = {
        "eval_accuracy": held_out["accuracy"],
        "eval_loss": held_out["loss"],
        "eval_margin": held_out["margin"],
        "eval_pairs": len(eval_pairs),
        "train_accuracy": train_eval["accuracy"],
        "train_loss": stats.get("rm/train_loss", float("nan")),
        "train_pairs": len(train_pairs),
        "steps": steps,
        "skipped": skipped,
        "truncated": truncated,
        "reward_mean": float(r_all.mean()),
        "reward_std": float(r_all.std()) if len(r_all) > 1 else 1.0,
        "max_length": cfg.max_length,
    }
    if truncated:
        log(f"truncated {truncated} inputs to their last {cfg.max_length} tokens")

    def curves(tmp: Path) -> None:  # per-step curves, in the new directory before the swap
        with MetricsLogger(
            tmp, tensorboard=cfg.tensorboard, resume_step=-1, run_name=Path(cfg.output_dir).name
        ) as logger:
            for i, rec in enumerate(history, start=1):
                logger.log(i, rec)
            logger.log(
                steps, {"rm/eval_accuracy": held_out["accuracy"], "rm/eval_loss": held_out["loss"]}
            )

    save_model_atomic(
        model,
        tokenizer,
        cfg.output_dir,
        extra_files={RM_STATS_FILE: json.dumps(result, indent=2) + "\n"},
        fill_more=curves,
    )
    return result
