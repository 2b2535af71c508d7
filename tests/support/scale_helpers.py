"""Builders for the scale tests (precision, FSDP2, LoRA): a random Experience for a tiny model
and a run config over it, without rollouts (the trainer's update path only)."""

from __future__ import annotations

from pathlib import Path

import torch

from relayrl.config import RunConfig, load_config
from relayrl.model import model_vocab_size, pack_batch
from relayrl.workers import Experience


def random_experience(
    model_dir: Path, rows: int = 8, seed: int = 0, dtype: torch.dtype = torch.float32
) -> Experience:
    """``rows`` ragged prompt+response rows of random tokens with random advantages (some rows
    all-zero, as GRPO groups with equal rewards) and pi_old = behaviour logprobs unset."""
    g = torch.Generator().manual_seed(seed)
    vocab = model_vocab_size(model_dir) or 32
    prompts, responses = [], []
    for _ in range(rows):
        p = int(torch.randint(2, 6, (1,), generator=g))
        r = int(torch.randint(1, 7, (1,), generator=g))
        prompts.append(torch.randint(3, vocab, (p,), generator=g).tolist())
        responses.append(torch.randint(3, vocab, (r,), generator=g).tolist())
    batch = pack_batch(prompts, responses, pad_id=0)
    exp = Experience(batch)
    adv = torch.randn(rows, 1, generator=g, dtype=dtype).expand_as(batch.response_mask).clone()
    adv[::4] = 0.0
    exp.advantages = adv * batch.response_mask.to(dtype)
    return exp


def scale_config(model_dir: Path, *overrides: str) -> RunConfig:
    """A GRPO config on ``model_dir``: one update per step unless overridden, lr large enough
    that a step visibly moves a tiny model."""
    return load_config(
        RunConfig,
        None,
        [
            f"model.path={model_dir}",
            "threads=1",
            "optim.lr=1e-2",
            "algo.mini_batches=1",
            "logging.progress=false",
            "logging.tensorboard=false",
            *overrides,
        ],
    )
