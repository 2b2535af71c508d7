"""Per-token quantities from logits [B, T, V]: logprob of the chosen token and entropy.

Both work on chunks of flattened positions so that the fp32 copy of bf16/fp16 logits (and
the softmax) never exceeds ``chunk_size * V`` elements at a time. fp64 input stays fp64.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _check_chunk(chunk_size: int, temperature: float) -> None:
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def logprobs_from_logits(
    logits: Tensor, token_ids: Tensor, temperature: float = 1.0, chunk_size: int = 1024
) -> Tensor:
    """log pi(y_t) = l[y_t] - logsumexp(l) for l = logits / temperature, in (at least) fp32.

    The log-softmax gather of any policy-gradient method (REINFORCE, Williams 1992), without
    materialising the full log-softmax. ``temperature`` must match the sampler's.
    """
    _check_chunk(chunk_size, temperature)
    if logits.dim() < 2 or logits.shape[:-1] != token_ids.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} must be token_ids {tuple(token_ids.shape)} + [V]"
        )
    dtype = _compute_dtype(logits.dtype)
    flat = logits.reshape(-1, logits.shape[-1])
    ids = token_ids.reshape(-1, 1).long()
    out: list[Tensor] = []
    for start in range(0, flat.shape[0], chunk_size):
        chunk = flat[start : start + chunk_size].to(dtype)
        if temperature != 1.0:
            chunk = chunk / temperature
        picked = chunk.gather(-1, ids[start : start + chunk_size]).squeeze(-1)
        out.append(picked - torch.logsumexp(chunk, dim=-1))
    if not out:
        return logits.new_zeros(token_ids.shape, dtype=dtype)
    return torch.cat(out).reshape(token_ids.shape)


def entropy_from_logits(logits: Tensor, chunk_size: int = 1024, temperature: float = 1.0) -> Tensor:
    """H = logsumexp(l) - sum_v softmax(l)_v * l_v (Shannon entropy of the token distribution;
    the entropy bonus of A3C, Mnih et al. 2016), chunked over flattened positions.

    -inf logits (banned tokens) are allowed: they contribute 0 and give no NaN gradient.
    """
    _check_chunk(chunk_size, temperature)
    if logits.dim() < 1:
        raise ValueError("logits must have a vocabulary dimension")
    dtype = _compute_dtype(logits.dtype)
    flat = logits.reshape(-1, logits.shape[-1])
    out: list[Tensor] = []
    for start in range(0, flat.shape[0], chunk_size):
        chunk = flat[start : start + chunk_size].to(dtype)
        if temperature != 1.0:
            chunk = chunk / temperature
        # -inf * softmax 0 would be NaN; the most negative finite value gives 0 instead.
        chunk = chunk.clamp(min=torch.finfo(dtype).min)
        probs = torch.softmax(chunk, dim=-1)
        out.append(torch.logsumexp(chunk, dim=-1) - (probs * chunk).sum(-1))
    if not out:
        return logits.new_zeros(logits.shape[:-1], dtype=dtype)
    return torch.cat(out).reshape(logits.shape[:-1])
