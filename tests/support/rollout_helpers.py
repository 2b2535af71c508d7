"""Shared helpers for the rollout tests: tiny models and reference computations."""

from __future__ import annotations

from pathlib import Path

import torch

from relayrl.model.loading import load_causal_lm
from relayrl.model.tiny import build_tiny_model

PAD, EOS = 0, 2


def tiny_model(root: Path, arch: str, seed: int = 0, **kw: object) -> torch.nn.Module:
    """Build (once per directory) and load a tiny random model."""
    out = root / f"{arch}-{seed}"
    if not (out / "config.json").exists():
        build_tiny_model(out, arch=arch, seed=seed, **kw)  # type: ignore[arg-type]
    return load_causal_lm(out).eval()


def random_prompts(lengths: list[int], seed: int = 0, lo: int = 4, hi: int = 80) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(lo, hi, (n,), generator=g).tolist() for n in lengths]


@torch.no_grad()
def recompute_logprobs(
    model: torch.nn.Module, prompt: list[int], response: list[int], temperature: float = 1.0
) -> torch.Tensor:
    """Per-token logprobs of ``response`` by one plain unpadded forward (the trainer's view)."""
    ids = torch.tensor([prompt + response])
    logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1 : -1].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(1, torch.tensor(response).unsqueeze(1)).squeeze(1)


@torch.no_grad()
def hf_greedy(
    model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """``transformers`` ``generate(do_sample=False)`` on a left-padded batch; responses cut
    after the first EOS (which is kept)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    out = model.generate(
        ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )
    res = []
    for row in out[:, width:].tolist():
        if EOS in row:
            row = row[: row.index(EOS) + 1]
        res.append(row)
    return res
