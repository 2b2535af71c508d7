"""Decode attention on the CPU that reads each row's own cache length, no padding, no copy.

A decode row ``i`` (one query token at position ``p_i`` of slot ``s_i``) attends to columns
``j = 0 .. p_i`` of its slot's keys/values in the arenas ``[S, Hkv, C, D]``::

    score_hj = (q_h . K[s_i, g(h), j]) * scale          g(h) = h // (H / Hkv)
    w_hj     = exp(score_hj - max_j score_hj) / sum_j exp(score_hj - max_j score_hj)
    out_h    = sum_j w_hj V[s_i, g(h), j]

SDPA on the CPU needs one rectangular ``[rows, Hkv, L, D]`` read per call: rows of a
heavy-tailed batch either attend over the longest row's columns (most of them masked) or are
split in length buckets, each a gathered copy of the cache, a mask and a call. This kernel
walks each row's ``p_i + 1`` columns straight out of the arena, with nothing built per step:
its work is the step's real context, ``sum_i (p_i + 1)``.

It is a few lines of C compiled once per machine with the system C compiler (``cc``, into
``$RELAYRL_CACHE_DIR`` or ``~/.cache/relayrl``, keyed by the source's hash) and called through
``ctypes``; float32 on the CPU only. When no compiler is there, or for another dtype or
device, ``available()`` is False and the runner keeps SDPA. The dot products and the weighted
sum run in float32 in a fixed order (8 partial sums over ``D``, then pairwise), so results
do not depend on compiler vectorisation; they agree with SDPA to float32 rounding (~1e-7).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import tempfile
import threading
from pathlib import Path

import torch
from torch import Tensor

SOURCE = r"""
#include <math.h>
#include <stdint.h>

/* sum_k a[k] b[k] in a fixed order: 8 partial sums (k mod 8), then pairwise */
static inline float dot(const float *a, const float *b, int64_t d) {
    float p[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t k = 0;
    for (; k + 8 <= d; k += 8)
        for (int t = 0; t < 8; ++t) p[t] += a[k + t] * b[k + t];
    for (; k < d; ++k) p[k & 7] += a[k] * b[k];
    return ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
}

/* q, out: [n, H, D]; k, v: [S, Hkv, C, D]; rows, lens: [n]; scores: >= (H / Hkv) * max(lens).
   The G = H / Hkv query heads of kv head g (h = g G .. g G + G - 1) read its keys once. */
void decode_attention_f32(const float *q, const float *k, const float *v,
                          const int64_t *rows, const int64_t *lens, float *out,
                          int64_t n, int64_t heads, int64_t kv_heads, int64_t cols,
                          int64_t dim, float scale, float *scores) {
    const int64_t group = heads / kv_heads;
    for (int64_t i = 0; i < n; ++i) {
        const int64_t len = lens[i];
        for (int64_t g = 0; g < kv_heads; ++g) {
            const float *qg = q + (i * heads + g * group) * dim;
            const float *kb = k + ((rows[i] * kv_heads + g) * cols) * dim;
            const float *vb = v + ((rows[i] * kv_heads + g) * cols) * dim;
            float *og = out + (i * heads + g * group) * dim;
            for (int64_t j = 0; j < len; ++j)
                for (int64_t r = 0; r < group; ++r)
                    scores[r * len + j] = dot(qg + r * dim, kb + j * dim, dim) * scale;
            for (int64_t r = 0; r < group; ++r) {
                float *s = scores + r * len;
                float m = -INFINITY, total = 0.0f;
                for (int64_t j = 0; j < len; ++j) m = s[j] > m ? s[j] : m;
                for (int64_t j = 0; j < len; ++j) {
                    s[j] = expf(s[j] - m);
                    total += s[j];
                }
                const float inv = 1.0f / total;
                for (int64_t j = 0; j < len; ++j) s[j] *= inv;
                float *o = og + r * dim;
                for (int64_t d = 0; d < dim; ++d) o[d] = 0.0f;
            }
            for (int64_t j = 0; j < len; ++j) {
                const float *vj = vb + j * dim;
                for (int64_t r = 0; r < group; ++r) {
                    const float w = scores[r * len + j];
                    float *o = og + r * dim;
                    for (int64_t d = 0; d < dim; ++d) o[d] += w * vj[d];
                }
            }
        }
    }
}
"""

_LOCK = threading.Lock()
_LIB: ctypes.CDLL | None = None
_TRIED = False
_ERROR: str | None = None


def _cache_dir() -> Path:
    root = os.environ.get("RELAYRL_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "relayrl"
    )
    return Path(root) / "kernels"


def _build() -> ctypes.CDLL:
    """Compile ``SOURCE`` once (atomic rename: concurrent builders never see a partial file)."""
    digest = hashlib.sha256(SOURCE.encode()).hexdigest()[:16]
    out_dir = _cache_dir()
    lib = out_dir / f"varlen_decode_{digest}.so"
    if not lib.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        cc = os.environ.get("CC", "cc")
        with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
            src = Path(tmp) / "varlen_decode.c"
            src.write_text(SOURCE)
            part = Path(tmp) / lib.name
            cmd = [
                cc,
                "-O3",
                "-fno-fast-math",
                "-fno-math-errno",
                "-shared",
                "-fPIC",
                str(src),
                "-o",
                str(part),
                "-lm",
            ]
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if res.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed: {res.stderr.strip()[:500]}")
            os.replace(part, lib)
    handle = ctypes.CDLL(str(lib))
    fn = handle.decode_attention_f32
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [ptr] * 6 + [i64] * 5 + [ctypes.c_float, ptr]
    fn.restype = None
    return handle


def _library() -> ctypes.CDLL | None:
    global _LIB, _TRIED, _ERROR
    if not _TRIED:
        with _LOCK:
            if not _TRIED:
                if os.environ.get("RELAYRL_VARLEN_DECODE", "1") == "0":
                    _ERROR = "turned off (RELAYRL_VARLEN_DECODE=0)"
                else:
                    try:
                        _LIB = _build()
                    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                        _ERROR = f"{type(e).__name__}: {e}"
                        logging.getLogger(__name__).warning(
                            "varlen decode attention unavailable, decode rows use SDPA "
                            "(slower on the CPU): %s",
                            _ERROR,
                        )
                _TRIED = True
    return _LIB


def available() -> bool:
    """Whether the compiled kernel is there (built on first call)."""
    return _library() is not None


def unavailable_reason() -> str | None:
    """Why ``available()`` is False (None when it is True or not asked yet)."""
    _library()
    return _ERROR


def decode_attention(
    query: Tensor,
    keys: Tensor,
    values: Tensor,
    rows: Tensor,
    lens: Tensor,
    max_len: int,
    scale: float,
) -> Tensor:
    """Each decode row on its own slot's first ``lens[i]`` cache columns.

    ``query`` ``[n, H, 1, D]`` float32; ``keys``/``values`` the layer's arenas ``[S, Hkv, C,
    D]`` (contiguous); ``rows``/``lens`` int64 ``[n]`` (arena row, columns to read, each
    ``<= C``); ``max_len = max(lens)``. The values of ``rows`` and ``lens`` are trusted (in
    ``[0, S)`` and ``[1, max_len]``: the runner builds them from its slot table; checking them
    here would read the tensors back to the host every layer). Returns ``[n, 1, H, D]`` like
    ``sdpa_attention_forward``.
    """
    lib = _library()
    assert lib is not None, unavailable_reason()
    n, heads, _, dim = query.shape
    slots, kv_heads, cols, kdim = keys.shape
    if kdim != dim or values.shape != keys.shape or heads % kv_heads:
        raise ValueError(f"query {tuple(query.shape)} does not fit the arena {tuple(keys.shape)}")
    if max_len > cols:
        raise ValueError(f"rows read {max_len} columns, the arena holds {cols}")
    # The C code trusts its pointers: everything on the CPU, of its dtype, laid out as said.
    for name, t, dtype in (
        ("query", query, torch.float32),
        ("keys", keys, torch.float32),
        ("values", values, torch.float32),
        ("rows", rows, torch.int64),
        ("lens", lens, torch.int64),
    ):
        if t.device.type != "cpu" or t.dtype != dtype:
            raise ValueError(f"{name} must be {dtype} on the CPU, got {t.dtype} on {t.device}")
    if not (keys.is_contiguous() and values.is_contiguous()):
        raise ValueError("the arenas must be contiguous")
    if rows.shape != (n,) or lens.shape != (n,):
        raise ValueError(f"rows/lens must be [{n}], got {tuple(rows.shape)}/{tuple(lens.shape)}")
    q = query.contiguous()
    rows, lens = rows.contiguous(), lens.contiguous()
    # explicit device: a default device set by the caller (e.g. meta) must not apply here
    out = torch.empty(n, heads, dim, dtype=torch.float32, device="cpu")
    scores = torch.empty(heads * max(1, max_len), dtype=torch.float32, device="cpu")
    lib.decode_attention_f32(
        q.data_ptr(),
        keys.data_ptr(),
        values.data_ptr(),
        rows.data_ptr(),
        lens.data_ptr(),
        out.data_ptr(),
        n,
        heads,
        kv_heads,
        cols,
        dim,
        float(scale),
        scores.data_ptr(),
    )
    return out.view(n, 1, heads, dim)
