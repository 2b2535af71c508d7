"""The split step's attention: decode rows on their slot's cache, prefill tokens on their prompt.

A split forward (``relayrl.rollout.model_runner``) holds ONE token per batch row: first the
decode rows, then every prefill token, flat. Its attention runs through
:func:`split_attention`, registered with ``transformers``' ``AttentionInterface`` as
``SPLIT_ATTENTION`` (the module path swaps it in for one forward, :func:`split_attention_active`;
the direct path calls it itself). The step's plan (:class:`SplitState`) is a thread-local set
for the duration of the forward:

- decode rows attend per length bucket to their slots' cache read
  (:func:`decode_attention`: grouped-query heads as query positions of one kv head, no copy
  of the cache);
- prefill tokens attend causally within their own prompt (:func:`prefill_attention`): one
  SDPA call over all of them with a block-diagonal mask, or one plain-causal call per prompt
  when that costs less (``ModelRunner._prompt_by_prompt``);
- or, in float32 on the CPU, every row of the step, decode row or prompt token, in one call
  of ``cpu_kernels.varlen_decode`` reading its own slot's first ``position + 1`` columns
  (``SplitState.decode_varlen``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from relayrl.rollout.cpu_kernels import varlen_decode
from relayrl.rollout.kv_cache import SlotKVCache, read_rows

SPLIT_ATTENTION = "relayrl_split_sdpa"
GROUPED_DECODE = True
"""Decode rows attend through ``decode_attention`` (no ``repeat_kv`` copy of the cache);
False: through ``transformers``' ``sdpa_attention_forward`` (benchmarks compare the two)."""


@dataclass
class SplitState:
    cache: SlotKVCache
    n_decode: int  # batch rows [0, n_decode) are decode rows; the rest are prefill tokens
    # the decode rows' length buckets (one when lengths are alike): (first row, end row,
    # additive mask [rows, 1, 1, columns]); their keys/values are ``cache.split_buckets``
    decode_buckets: list[tuple[int, int, Tensor]]
    # [1, 1, P, P] additive, block-diagonal causal; None: no prefill, or prompt by prompt
    prefill_mask: Tensor | None
    # set when the prompts attend prompt by prompt (one plain-causal call each, no mask; a
    # single prompt always does): their lengths, in batch order
    prefill_lengths: list[int] | None = None
    # set when the rows attend through ``varlen_decode`` (no buckets; the runner then counts
    # every token of the step, prompt tokens too, in ``n_decode``): their arena rows, the
    # columns each reads (int64 ``[n_decode]``: position + 1) and the most any reads
    decode_varlen: tuple[Tensor, Tensor, int] | None = None


ACTIVE = threading.local()


def split_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """Attention of a split step: decode rows on the cache, prefill tokens on their prompt.
    ``kwargs``: the model's attention keywords, passed on to ``sdpa_attention_forward``."""
    state: SplitState | None = getattr(ACTIVE, "state", None)
    if state is None:  # not inside an engine forward: plain SDPA
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    n = state.n_decode
    parts = []
    assert state.cache.split_buckets is not None
    grouped = (
        GROUPED_DECODE and "position_bias" not in kwargs and not kwargs.get("output_attentions")
    )
    buckets = list(zip(state.decode_buckets, state.cache.split_buckets, strict=True))
    if state.decode_varlen is not None and n:
        rows, lens, max_len = state.decode_varlen
        assert state.cache.split_arenas is not None
        keys, values = state.cache.split_arenas
        if grouped:  # the kernel: every row on its own columns of the arena
            scaling = kwargs.get("scaling")
            scale = scaling if isinstance(scaling, float) else query.shape[-1] ** -0.5
            parts.append(
                varlen_decode.decode_attention(query[:n], keys, values, rows, lens, max_len, scale)
            )
        else:  # sdpa_attention_forward's extras wanted: the rows as one masked bucket
            mask = causal_mask((lens - 1).view(-1, 1, 1), max_len, query.dtype)
            k, v = read_rows(keys, rows, max_len), read_rows(values, rows, max_len)
            buckets = [((0, n, mask), (k, v))]
    for (lo, hi, mask), (k, v) in buckets:
        if grouped:
            parts.append(decode_attention(query[lo:hi], k, v, mask, kwargs.get("scaling")))
        else:
            out, _ = sdpa_attention_forward(module, query[lo:hi], k, v, mask, **kwargs)
            parts.append(out)  # [rows, 1, H, D]
    if query.shape[0] > n:
        # The prefill tokens as one sequence [1, H, P, D] with a block-diagonal causal mask.
        q, k, v = (t[n:].transpose(0, 2) for t in (query, key, value))
        scaling = kwargs.get("scaling")
        if state.prefill_lengths is None:  # one call, the block-diagonal mask
            if grouped:
                out = prefill_attention(q, k, v, state.prefill_mask, scaling)
            else:
                out, _ = sdpa_attention_forward(module, q, k, v, state.prefill_mask, **kwargs)
        else:  # prompt by prompt, plain causal each
            outs, start = [], 0
            for length in state.prefill_lengths:
                qi, ki, vi = (t[:, :, start : start + length] for t in (q, k, v))
                if grouped:
                    outs.append(prefill_attention(qi, ki, vi, None, scaling))
                else:
                    outs.append(sdpa_attention_forward(module, qi, ki, vi, None, **kwargs)[0])
                start += length
            out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        parts.append(out.transpose(0, 1))  # [P, 1, H, D]
    return (parts[0] if len(parts) == 1 else torch.cat(parts)), None


def decode_attention(
    query: Tensor, key: Tensor, value: Tensor, mask: Tensor, scaling: object
) -> Tensor:
    """Decode rows' attention on their cache read, without copying the cache.

    ``query`` ``[n, H, 1, D]``, ``key``/``value`` ``[n, Hkv, L, D]`` (a strided view of the
    arena), ``mask`` ``[n, 1, 1, L]``. With grouped-query attention (``G = H / Hkv`` query
    heads share kv head ``h // G``, as ``repeat_kv`` pairs them) the ``G`` heads of a group
    become ``G`` query positions of one kv head: ``[n, Hkv, G, D]`` against ``[n, Hkv, L, D]``,
    the same dot products as repeating the keys ``G`` times, without the copy of every
    layer's whole cache read that ``repeat_kv`` makes (the largest cost of a wide decode
    step). Returns ``[n, 1, H, D]`` like ``sdpa_attention_forward``.
    """
    n, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    q = query.reshape(n, kv_heads, heads // kv_heads, dim)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, key, value, attn_mask=mask, scale=scaling if isinstance(scaling, float) else None
    )
    return out.reshape(n, 1, heads, dim)


def prefill_attention(
    query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, scaling: object
) -> Tensor:
    """The prefill tokens' attention as one sequence: ``query`` ``[1, H, P, D]``,
    ``key``/``value`` ``[1, Hkv, P, D]``, ``mask`` ``[1, 1, P, P]`` additive block-diagonal
    causal, or None for one prompt (plain causal, no mask built). Grouped-query heads
    through SDPA's ``enable_gqa`` instead of ``repeat_kv``'s copies of the keys and values:
    the same outputs bit for bit, and faster on the CPU (docs/measurements.md). Returns
    ``[1, P, H, D]`` like ``sdpa_attention_forward``."""
    out = torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=mask,
        is_causal=mask is None,
        scale=scaling if isinstance(scaling, float) else None,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return out.transpose(1, 2)


AttentionInterface.register(SPLIT_ATTENTION, split_attention)


@contextlib.contextmanager
def split_attention_active(model: PreTrainedModel, state: SplitState) -> Iterator[None]:
    """Route the model's attention through ``split_attention`` for one forward."""
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = SPLIT_ATTENTION
    ACTIVE.state = state
    try:
        yield
    finally:
        ACTIVE.state = None
        config._attn_implementation = previous


def causal_mask(position_ids: Tensor, kv_len: int, dtype: torch.dtype) -> Tensor:
    """Additive mask ``[n, 1, q, kv_len]`` from ``position_ids`` ``[n, 1, q]``: query at
    position p sees cache columns ``j <= p`` (on ``position_ids``' device)."""
    dev = position_ids.device
    allowed = torch.arange(kv_len, device=dev).view(1, 1, 1, kv_len) <= position_ids.unsqueeze(-1)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=dev)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)
