"""Offline DPO (Rafailov et al. 2023): the no-RL baseline on the same preference pairs.

Run with ``algo.name: dpo`` in a run config (``relayrl train``) or ``relayrl dpo CONFIG``.
Per pair (x, y_w, y_l), with the frozen initial model as pi_ref and beta = ``algo.kl_coef``:

    h = beta * [(log pi(y_w|x) - log pi_ref(y_w|x)) - (log pi(y_l|x) - log pi_ref(y_l|x))]
    L = -mean log sigmoid(h)

log pi(y|x) sums the completion's token logprobs, EOS included (the completion ends there).
The implicit rewards beta * (log pi - log pi_ref) of chosen and rejected are logged, and the
held-out accuracy is the fraction of pairs with h > 0. Settings used from the run config:
``model.path``, ``data.train_path`` (JSONL or local HF dataset of prompt/chosen/rejected),
``data.eval_path`` (else 10% held out), ``algo.prompts_per_step`` (pairs per step),
``algo.micro_batch_size``, ``optim.*``, ``train.steps`` / ``eval_every`` / ``save_every``.
Checkpoints are ``run_dir/checkpoints/step_N/actor`` in Hugging Face format.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from relayrl.algos.preference_loss import dpo_loss
from relayrl.config import RunConfig
from relayrl.controller.checkpoint import (
    latest_checkpoint,
    load_trainer_state,
    save_checkpoint,
)
from relayrl.controller.run_dir import record_config
from relayrl.data.preferences import PreferencePair, load_preferences, split_pairs
from relayrl.durable import mkdir_durable
from relayrl.model import (
    forward_logprobs,
    load_causal_lm,
    load_tokenizer,
    pack_batch,
    set_threads,
)
from relayrl.telemetry import MetricsLogger, StepProgress, print_summary
from relayrl.workers.optim import make_optimizer

__all__ = ["DPO_EVAL_FRACTION", "dpo_loss", "evaluate_dpo", "sequence_logprobs", "train_dpo"]

DPO_EVAL_FRACTION = 0.1
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def _token_pairs(
    tokenizer: Any, prompts: Sequence[str], completions: Sequence[str]
) -> tuple[list[list[int]], list[list[int]]]:
    """Prompt ids as the RL path tokenises them (never empty: BOS/EOS stands in for an empty
    prompt); completion ids + EOS."""
    filler = (
        tokenizer.bos_token_id if tokenizer.bos_token_id is not None else (tokenizer.eos_token_id)
    )
    p_ids, c_ids = [], []
    for p, c in zip(prompts, completions, strict=True):
        ids = list(tokenizer(p).input_ids) if p else []
        p_ids.append(ids or [filler])
        c_ids.append(
            list(tokenizer(c, add_special_tokens=False).input_ids) + [tokenizer.eos_token_id]
        )
    return p_ids, c_ids


def sequence_logprobs(
    model: torch.nn.Module, tokenizer: Any, prompts: Sequence[str], completions: Sequence[str]
) -> Tensor:
    """log pi(y|x) = sum_t log pi(y_t | x, y_<t) over completion tokens + EOS [B]."""
    p_ids, c_ids = _token_pairs(tokenizer, prompts, completions)
    batch = pack_batch(p_ids, c_ids, tokenizer.pad_token_id)
    logp, _ = forward_logprobs(model, batch)
    return (logp * batch.response_mask).sum(-1)


def _pair_logps(
    model: torch.nn.Module, tokenizer: Any, pairs: Sequence[PreferencePair]
) -> tuple[Tensor, Tensor]:
    prompts = [p.prompt for p in pairs]
    logps = sequence_logprobs(
        model, tokenizer, prompts * 2, [p.chosen for p in pairs] + [p.rejected for p in pairs]
    )
    return logps[: len(pairs)], logps[len(pairs) :]


@torch.no_grad()
def evaluate_dpo(
    model: torch.nn.Module,
    reference: torch.nn.Module,
    tokenizer: Any,
    pairs: Sequence[PreferencePair],
    beta: float,
    batch_size: int = 64,
) -> dict[str, float]:
    """Held-out DPO loss, implicit-reward accuracy and margins (``dpo_eval/*``)."""
    if not pairs:
        return {}
    was_training = model.training
    model.eval()
    parts = []
    for s in range(0, len(pairs), batch_size):
        chunk = pairs[s : s + batch_size]
        pc, pr = _pair_logps(model, tokenizer, chunk)
        rc, rr = _pair_logps(reference, tokenizer, chunk)
        parts.append((pc, pr, rc, rr))
    model.train(was_training)
    pc, pr, rc, rr = (torch.cat([p[i] for p in parts]) for i in range(4))
    loss, stats = dpo_loss(pc, pr, rc, rr, beta)
    return {"dpo_eval/loss": float(loss), **{f"dpo_eval/{k}": v for k, v in stats.items()}}


def _load_pairs(cfg: RunConfig) -> tuple[list[PreferencePair], list[PreferencePair]]:
    if cfg.data.train_path is None:
        raise ValueError("algo.name 'dpo' needs data.train_path (preference pairs)")
    data = load_preferences(cfg.data.train_path)
    if data.skipped:
        print(data.skip_summary())
    if cfg.data.eval_path is not None:
        held = load_preferences(cfg.data.eval_path)
        if held.skipped:
            print(held.skip_summary())
        return list(data.pairs), held.pairs[: cfg.data.eval_size]
    train, held_out = split_pairs(data.pairs, DPO_EVAL_FRACTION, cfg.seed)
    return train, held_out[: cfg.data.eval_size]


def train_dpo(cfg: RunConfig, resume: bool = False) -> dict[str, Any]:
    """Run ``train.steps`` DPO steps; return the final train and held-out metrics
    (``eval_before`` / ``eval_after`` hold the held-out implicit-reward accuracy)."""
    beta = cfg.algo.kl_coef
    if beta <= 0:
        raise ValueError("algo.name 'dpo' needs algo.kl_coef > 0 (DPO's beta), e.g. 0.1")
    set_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    run_dir = Path(cfg.run_dir)
    mkdir_durable(run_dir)
    record_config(run_dir, cfg)  # as the RL run's: durable, a changed config kept as prev-N
    train_pairs, eval_pairs = _load_pairs(cfg)

    dtype = DTYPES[cfg.model.dtype]
    tokenizer = load_tokenizer(cfg.model.path)
    ckpt = latest_checkpoint(run_dir) if resume else None
    model = load_causal_lm(ckpt / "actor" if ckpt else cfg.model.path, dtype)
    reference = load_causal_lm(cfg.model.path, dtype).eval().requires_grad_(False)
    o = cfg.optim
    opt, sched = make_optimizer(
        list(model.parameters()), o.lr, o.weight_decay, o.betas, o.warmup_steps
    )
    start = 0
    if ckpt is not None:
        state = load_trainer_state(ckpt)
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        start = int(state["step"])
        print(f"resumed from {ckpt} at step {start}")

    a = cfg.algo
    logger = MetricsLogger(
        run_dir, tensorboard=cfg.logging.tensorboard, resume_step=start if start > 0 else -1
    )
    first = evaluate_dpo(model, reference, tokenizer, eval_pairs, beta, a.micro_batch_size)
    if start == 0 and first:
        logger.log(0, first)
    stats: dict[str, float] = {}
    model.train()
    with StepProgress(cfg.train.steps - start, "dpo", enabled=cfg.logging.progress) as bar:
        for step in range(start, cfg.train.steps):
            # the pairs of a step are a pure function of (seed, step): resume draws the same
            rng = random.Random(cfg.seed * 1_000_003 + step)
            batch = [
                train_pairs[rng.randrange(len(train_pairs))] for _ in range(a.prompts_per_step)
            ]
            opt.zero_grad(set_to_none=True)
            sums: dict[str, float] = {}
            for s in range(0, len(batch), a.micro_batch_size):
                micro = batch[s : s + a.micro_batch_size]
                w = len(micro) / len(batch)
                with torch.no_grad():
                    rc, rr = _pair_logps(reference, tokenizer, micro)
                pc, pr = _pair_logps(model, tokenizer, micro)
                loss, st = dpo_loss(pc, pr, rc, rr, beta)
                (loss * w).backward()  # micro means weighted by share = the batch mean
                st["loss"] = float(loss.detach())
                for k, v in st.items():
                    sums[k] = sums.get(k, 0.0) + v * w
            max_norm = o.grad_clip if o.grad_clip is not None else float("inf")
            grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
            opt.step()
            sched.step()
            stats = {f"dpo/{k}": v for k, v in sums.items()}
            stats["dpo/grad_norm"] = grad_norm
            done = step + 1
            if cfg.train.eval_every and done % cfg.train.eval_every == 0:
                stats.update(
                    evaluate_dpo(model, reference, tokenizer, eval_pairs, beta, a.micro_batch_size)
                )
            logger.log(done, stats)
            bar.update(done - start, loss=stats["dpo/loss"], acc=stats["dpo/accuracy"])
            if (cfg.train.save_every and done % cfg.train.save_every == 0) or (
                done == cfg.train.steps
            ):
                save_checkpoint(
                    run_dir,
                    done,
                    {"actor": model},
                    tokenizer,
                    {"optimizer": opt.state_dict(), "scheduler": sched.state_dict()},
                    cfg.train.keep_checkpoints,
                )
    last = evaluate_dpo(model, reference, tokenizer, eval_pairs, beta, a.micro_batch_size)
    if last:
        logger.log(cfg.train.steps, last)
    logger.close()
    print_summary(
        logger.history,
        ["dpo/loss", "dpo/accuracy", "dpo/margin", "dpo_eval/accuracy"],
        f"dpo on {cfg.model.path}",
    )
    return {
        **stats,
        **last,
        "eval_before": first.get("dpo_eval/accuracy"),
        "eval_after": last.get("dpo_eval/accuracy"),
        "train_pairs": len(train_pairs),
        "eval_pairs": len(eval_pairs),
    }
