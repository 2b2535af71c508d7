"""Batched sampling with per-request settings and per-request, batch-independent randomness.

Behaviour logprobs (a contract): the logprob of the sampled token under the
exact distribution it was drawn from, in fp32:

    logits / temperature  ->  top-k filter  ->  top-p filter  ->  log_softmax (renormalised)

so with top-k / top-p the reported logprob is under the *filtered, renormalised* distribution
(filtered-out tokens have probability 0). Greedy requests (``greedy=True`` or temperature 0)
take the argmax of the raw logits and report its logprob under the temperature-1, unfiltered
distribution.

Randomness: token ``t`` of a request is drawn by inverse-CDF sampling (vocabulary order) with
one uniform ``u = U(seed, t)`` from a counter-based generator (SplitMix64 of the request seed
and the token index). A request's samples therefore depend only on its seed, its prompt and
the weights, never on which other requests share the batch, which slot it sits in, or
whether it was interrupted and re-prefilled. It is the stateless equivalent of one
``torch.Generator`` per request, without a Python-level draw per row per step, and it needs
no generator on the logits' device: the uniforms are computed on the host (the same numbers
on every device) and copied with the step's other inputs.

On the CPU (float32 logits, the step library of ``relayrl.rollout.cpu_kernels.varlen_decode`` built)
everything after the log_softmax, i.e. the uniforms, the float64 CDF, the search, greedy
rows' argmax and the token's logprob, runs in one C call (``sample_rows_f32``) with the same
results as the torch operations (``tests/unit/rollout/test_step_kernels.py``) in less time
(docs/measurements.md).

Device. Every tensor is made on the logits' device (``relayrl.rollout.transfer``); the
tokens and logprobs come back in one transfer, the step's only device -> host sync.
"""

from __future__ import annotations

import ctypes
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from relayrl.rollout.cpu_kernels import varlen_decode
from relayrl.rollout.transfer import device_tensor, to_host

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform(seed: int, index: int) -> float:
    """A uniform in [0, 1) that depends only on (seed, index)."""
    x = _splitmix64(_splitmix64(seed & _MASK64) ^ (index & _MASK64))
    return (x >> 11) * (1.0 / (1 << 53))


@dataclass(slots=True)
class SamplingSettings:
    """A request's sampling settings, normalised once at submit time."""

    greedy: bool
    temperature: float  # 1.0 for greedy rows
    top_k: int  # 0 = off (always 0 for greedy rows)
    top_p: float  # 1.0 = off (always 1.0 for greedy rows)
    seed: int

    @property
    def filters(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0


def _filter_top_k_top_p(scaled: Tensor, top_k: Sequence[int], top_p: Sequence[float]) -> Tensor:
    """Set logits outside each row's top-k, then outside its top-p nucleus, to -inf."""
    vocab, dev = scaled.shape[-1], scaled.device
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    ks = device_tensor([k if 0 < k < vocab else vocab for k in top_k], torch.long, dev)
    rank = torch.arange(vocab, device=dev).unsqueeze(0)
    remove = rank >= ks.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    ps = device_tensor(list(top_p), torch.float32, dev).unsqueeze(1)
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token when the mass strictly before it already reaches top_p (the top-1 token
    # is always kept).
    mass_before = probs.cumsum(dim=-1) - probs
    remove = remove | ((mass_before >= ps) & (ps < 1.0))
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(1, order, sorted_logits)


def sample(
    logits: Tensor, settings: Sequence[SamplingSettings], token_index: Sequence[int]
) -> tuple[list[int], list[float]]:
    """Draw one token per row. Returns (token ids, behaviour logprobs) as Python lists.

    ``logits`` is fp32 ``[n, vocab]`` on any device; ``token_index[i]`` is the index of the
    token being drawn within row ``i``'s response (the counter of its random stream).
    """
    dev = logits.device
    greedy = [s.greedy for s in settings]
    if all(greedy):
        logp = torch.log_softmax(logits, dim=-1)
        if lib := _c_library(logits, logp):
            return _draw_c(lib, logits, logp, None, settings, token_index, greedy)
        tokens = logits.argmax(dim=-1, keepdim=True)  # [n, 1]
        return to_host(tokens, logp.gather(1, tokens), logits.shape[-1])
    temps = [s.temperature for s in settings]
    scaled = logits
    if any(t != 1.0 for t in temps):
        scaled = logits / device_tensor(temps, logits.dtype, dev).unsqueeze(1)
    if any(s.filters for s in settings):
        scaled = _filter_top_k_top_p(
            scaled, [s.top_k for s in settings], [s.top_p for s in settings]
        )
    logp = torch.log_softmax(scaled, dim=-1)
    if lib := _c_library(logits, logp):
        return _draw_c(lib, logits, logp, logp.exp(), settings, token_index, greedy)
    cdf = logp.exp().double().cumsum(dim=-1)
    u = device_tensor(
        [uniform(s.seed, t) for s, t in zip(settings, token_index, strict=True)],
        torch.float64,
        dev,
    ).unsqueeze(1)
    tokens = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)  # [n, 1]
    tokens.clamp_(max=logits.shape[-1] - 1)
    if any(greedy):
        argmax = logits.argmax(dim=-1, keepdim=True)
        tokens = torch.where(device_tensor(greedy, torch.bool, dev).unsqueeze(1), argmax, tokens)
    return to_host(tokens, logp.gather(1, tokens), logits.shape[-1])


C_DRAW = True
"""Draw float32 CPU rows with the compiled ``sample_rows_f32`` (``varlen_decode``'s library)
when it is built: the same tokens and logprobs as the torch ops (test), one call in place of
the CDF's nine operations and a Python SplitMix64 per row (greedy rows: the argmax and the
gather)."""


def _c_library(logits: Tensor, logp: Tensor) -> ctypes.CDLL | None:
    """The step library when these rows can take the C draw, else None (the torch ops)."""
    ok = (
        C_DRAW
        and logp.dtype == torch.float32
        and logits.dtype == torch.float32
        and logp.is_cpu
        and logits.is_cpu
        and logp.is_contiguous()
        and logits.stride(-1) == 1  # rows may be strided: the last token of each sequence
    )
    return varlen_decode.library() if ok else None


def _draw_c(
    lib: ctypes.CDLL,
    logits: Tensor,
    logp: Tensor,
    probs: Tensor | None,
    settings: Sequence[SamplingSettings],
    token_index: Sequence[int],
    greedy: Sequence[bool],
) -> tuple[list[int], list[float]]:
    """``sample``'s draw after its log_softmax in one C call (``sample_rows_f32``):
    ``logits`` (rows may be strided, columns contiguous), ``logp`` = log_softmax(scaled
    logits) and ``probs`` = exp(logp) (None when every row is greedy, contiguous), float32
    ``[n, vocab]`` on the CPU."""
    n, vocab = logp.shape
    tokens = array("q", bytes(8 * n))
    logprobs = array("d", bytes(8 * n))
    seeds = array("Q", [s.seed & _MASK64 for s in settings])
    index = array("Q", [t & _MASK64 for t in token_index])
    flags = array("b", greedy)
    cdf = torch.empty(vocab, dtype=torch.float64, device="cpu")  # scratch: not zeroed
    lib.sample_rows_f32(
        logits.data_ptr(),
        logits.stride(0),
        None if probs is None else probs.data_ptr(),
        logp.data_ptr(),
        n,
        vocab,
        seeds.buffer_info()[0],
        index.buffer_info()[0],
        flags.buffer_info()[0],
        tokens.buffer_info()[0],
        logprobs.buffer_info()[0],
        cdf.data_ptr(),
    )
    return tokens.tolist(), logprobs.tolist()
