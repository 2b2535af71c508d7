"""The decode rows' grouped-query attention (``split_attention.decode_attention``): the G query
heads of a kv head as G query positions, on a strided view of the cache arena, equal plain
softmax attention with the keys repeated G times (``repeat_kv``), computed here by hand."""

from __future__ import annotations

import math

import pytest
import torch

from relayrl.rollout.split_attention import decode_attention as _decode_attention


def _by_hand(q, k, v, lengths, scale):
    """out[n, h] = sum_j softmax_j(q[n,h] . k[n, h // G, j] * scale) v[n, h // G, j], j < len."""
    n, heads, _, d = q.shape
    group = heads // k.shape[1]
    out = torch.zeros(n, 1, heads, d, dtype=torch.float64)
    for r in range(n):
        for h in range(heads):
            kv = h // group
            logits = [float(q[r, h, 0] @ k[r, kv, j]) * scale for j in range(lengths[r])]
            m = max(logits)
            w = [math.exp(x - m) for x in logits]
            z = sum(w)
            for j in range(lengths[r]):
                out[r, 0, h] += (w[j] / z) * v[r, kv, j].double()
    return out


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (6, 1), (2, 2)])
def test_grouped_decode_attention_equals_repeated_keys(heads: int, kv_heads: int) -> None:
    g = torch.Generator().manual_seed(0)
    n, d, cols = 3, 8, 7
    arena_k = torch.randn(5, kv_heads, 9, d, generator=g)
    arena_v = torch.randn(5, kv_heads, 9, d, generator=g)
    k, v = arena_k[1:4, :, :cols], arena_v[1:4, :, :cols]  # strided views, as the cache reads
    q = torch.randn(n, 1, heads, d, generator=g).transpose(1, 2)  # [n, H, 1, D], as HF passes
    lengths = [7, 3, 5]
    mask = torch.zeros(n, 1, 1, cols)
    for r, length in enumerate(lengths):
        mask[r, 0, 0, length:] = torch.finfo(torch.float32).min
    for scale in (None, 0.3):
        got = _decode_attention(q, k, v, mask, scale)
        want = _by_hand(q, k, v, lengths, scale if scale is not None else d**-0.5)
        assert got.shape == (n, 1, heads, d)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
