"""Supervised fine-tuning on prompt/response pairs (the warm start before RL).

Loss: token-mean negative log-likelihood of the response tokens (response + EOS), prompt
tokens masked: L = -sum_t m_t log pi(y_t | x, y_<t) / sum_t m_t.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch

from relayrl.config import SFTConfig
from relayrl.data import ArithmeticTask, SFTRecord, load_sft_jsonl
from relayrl.model import forward_logprobs, load_causal_lm, load_tokenizer, pack_batch
from relayrl.telemetry import StepProgress
from relayrl.workers.optim import make_optimizer


def sft_records(cfg: SFTConfig) -> list[SFTRecord]:
    if cfg.task == "jsonl":
        if cfg.train_path is None:
            raise ValueError("train_path is required when task is 'jsonl'")
        return load_sft_jsonl(cfg.train_path)
    a = cfg.arithmetic
    task = ArithmeticTask(
        seed=cfg.seed + 1,
        min_operand=a.min_operand,
        max_operand=a.max_operand,
        operators=tuple(a.operators),
        num_operands=a.num_operands,
    )
    return task.sft_records(cfg.num_examples)


def tokenize_pair(tokenizer: Any, rec: SFTRecord) -> tuple[list[int], list[int]]:
    """Prompt ids as the RL path tokenises them; response ids end with EOS."""
    prompt = list(tokenizer(rec.prompt).input_ids)
    response = list(tokenizer(rec.response, add_special_tokens=False).input_ids)
    return prompt, response + [tokenizer.eos_token_id]


def run_sft(cfg: SFTConfig, exclude_prompts: set[str] | None = None) -> dict[str, float]:
    """Fine-tune ``model_path`` and save it (HF format, atomically) to ``output_dir``."""
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    tokenizer = load_tokenizer(cfg.model_path)
    model = load_causal_lm(cfg.model_path)
    records = [
        r for r in sft_records(cfg) if not exclude_prompts or r.prompt not in exclude_prompts
    ]
    pairs = [tokenize_pair(tokenizer, r) for r in records]
    if not pairs:
        raise ValueError("no SFT examples")
    opt, sched = make_optimizer(
        list(model.parameters()), cfg.lr, cfg.weight_decay, (0.9, 0.99), cfg.warmup_steps
    )
    rng = random.Random(cfg.seed)
    model.train()
    loss_val = float("nan")
    with StepProgress(cfg.steps, "sft", enabled=cfg.progress) as bar:
        for step in range(cfg.steps):
            chosen = [pairs[rng.randrange(len(pairs))] for _ in range(cfg.batch_size)]
            batch = pack_batch(
                [p for p, _ in chosen], [r for _, r in chosen], tokenizer.pad_token_id
            )
            logp, _ = forward_logprobs(model, batch)
            mask = batch.response_mask
            loss = -(logp * mask).sum() / mask.sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            sched.step()
            loss_val = float(loss.detach())
            bar.update(step + 1, loss=loss_val)
    save_model_atomic(model, tokenizer, cfg.output_dir)
    return {"sft/loss": loss_val, "sft/examples": float(len(pairs))}


def save_model_atomic(model: Any, tokenizer: Any, out_dir: str | Path) -> Path:
    """save_pretrained into a temp dir next to ``out_dir``, then swap it in."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp_{out.name}_{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if out.exists():
        old = out.parent / f".old_{out.name}_{os.getpid()}"
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)
    return out
