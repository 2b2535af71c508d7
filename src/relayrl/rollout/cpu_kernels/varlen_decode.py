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
its work is the step's real context, ``sum_i (p_i + 1)``. A prompt's tokens are rows of the
same call (token ``t`` reads columns ``0 .. t``, its own keys written before attention): the
causal mask of a prefill is each row's length, so a step with admissions needs no prefill
mask and no per-prompt call.

It is C (``varlen_decode.c``) compiled once per machine with the system C compiler
(``relayrl.rollout.cpu_kernels.build``) and called through ``ctypes``; float32 on the CPU only.
When no compiler is there, or for another dtype or device, ``available()`` is False and the
runner keeps SDPA. Per row and kv head, its query heads two at a time (each key and value block
read once for both): scores four columns per block, the softmax with its own exp (Cephes'
``expf`` polynomial), values in 16-float blocks, the next row's keys and values prefetched;
SSE2, or 8 lanes where the CPU has AVX2 (chosen at run time, ``wide_path``). The three paths
(plain C, SSE2, AVX2) give the same bits: how, in ``varlen_decode.c``. Results agree with SDPA
to float32 rounding (~1e-6 on scores of a few units).
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import threading

import torch
from torch import Tensor

from relayrl.rollout.cpu_kernels.build import build as _build

_LOCK = threading.Lock()
_LIB: ctypes.CDLL | None = None
_TRIED = False
_ERROR: str | None = None


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


def library() -> ctypes.CDLL | None:
    """The compiled library (built on first call), None where it is unavailable."""
    return _library()


def available() -> bool:
    """Whether the compiled kernel is there (built on first call)."""
    return _library() is not None


def wide_path(library: ctypes.CDLL | None = None) -> bool:
    """Whether the 8-wide (AVX2) path runs: chosen at run time where the CPU has AVX2; the
    same bits as the 4-wide SSE2 path either way."""
    lib = library or _library()
    return bool(lib is not None and lib.relayrl_wide())


def set_wide_path(on: bool, library: ctypes.CDLL | None = None) -> bool:
    """Turn the 8-wide path off (tests compare the paths' bits) or back on where the CPU has
    it; returns ``wide_path()``."""
    lib = library or _library()
    return bool(lib is not None and lib.relayrl_set_wide(int(on)))


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
    library: ctypes.CDLL | None = None,
) -> Tensor:
    """Each decode row on its own slot's first ``lens[i]`` cache columns.

    ``query`` ``[n, H, 1, D]`` float32; ``keys``/``values`` the layer's arenas ``[S, Hkv, C,
    D]`` (contiguous); ``rows``/``lens`` int64 ``[n]`` (arena row, columns to read, each
    ``<= C``); ``max_len = max(lens)``. The values of ``rows`` and ``lens`` are trusted (in
    ``[0, S)`` and ``[1, max_len]``: the runner builds them from its slot table; checking them
    here would read the tensors back to the host every layer). Returns ``[n, 1, H, D]`` like
    ``sdpa_attention_forward``. ``library``: another build of ``SOURCE`` (``_build``; tests
    run the plain C path through it).
    """
    n, heads, _, dim = query.shape
    call = Rows(rows, lens, max_len, library)
    return call(query.reshape(n, heads, dim), keys, values, scale).view(n, 1, heads, dim)


class Rows:
    """The kernel's calls over one step's rows, one per layer: ``rows``/``lens`` (int64
    ``[n]`` on the CPU: arena row, columns to read) checked and the scores buffer made once,
    not at every layer (the checks and allocations cost more than the kernel on a few rows).
    """

    def __init__(
        self, rows: Tensor, lens: Tensor, max_len: int, library: ctypes.CDLL | None = None
    ) -> None:
        lib = library or _library()
        assert lib is not None, unavailable_reason()
        self._fn = lib.decode_attention_f32
        self._layer = lib.attend_layer_f32
        n = rows.shape[0] if rows.dim() == 1 else -1
        for name, t in (("rows", rows), ("lens", lens)):
            if not t.is_cpu or t.dtype != torch.int64:
                raise ValueError(f"{name} must be int64 on the CPU, got {t.dtype} on {t.device}")
        if n < 0 or lens.shape != rows.shape:
            raise ValueError(f"rows/lens must be [n], got {tuple(rows.shape)}/{tuple(lens.shape)}")
        # kept: the C code reads them through these pointers
        self.rows, self.lens = rows.contiguous(), lens.contiguous()
        self.n, self.max_len = n, max_len
        self.width = max(1, max_len)
        # explicit device: a default device set by the caller (e.g. meta) must not apply here
        self._scores = torch.empty(2 * self.width, dtype=torch.float32, device="cpu")
        self._query: Tensor | None = None  # ``attend``'s rotated queries, reused every layer

    def __call__(self, query: Tensor, keys: Tensor, values: Tensor, scale: float) -> Tensor:
        """``query`` ``[n, H, D]`` float32; ``keys``/``values`` the layer's arenas ``[S, Hkv,
        C, D]`` (contiguous, float32, on the CPU); returns ``[n, H, D]``."""
        n, heads, dim = query.shape
        slots, kv_heads, cols, kdim = keys.shape
        if n != self.n or kdim != dim or values.shape != keys.shape or heads % kv_heads:
            raise ValueError(
                f"query {tuple(query.shape)} does not fit the arena {tuple(keys.shape)} "
                f"and {self.n} rows"
            )
        if self.max_len > cols:
            raise ValueError(f"rows read {self.max_len} columns, the arena holds {cols}")
        # The C code trusts its pointers: everything on the CPU, of its dtype, laid out as said.
        for name, t in (("query", query), ("keys", keys), ("values", values)):
            if not t.is_cpu or t.dtype != torch.float32:
                raise ValueError(f"{name} must be float32 on the CPU, got {t.dtype} on {t.device}")
        if not (keys.is_contiguous() and values.is_contiguous()):
            raise ValueError("the arenas must be contiguous")
        q = query.contiguous()
        out = torch.empty(n, heads, dim, dtype=torch.float32, device="cpu")
        self._fn(q.data_ptr(), *self._attention_args(keys, values, out, heads, scale))
        return out

    def _attention_args(
        self, keys: Tensor, values: Tensor, out: Tensor, heads: int, scale: float
    ) -> tuple[int | float, ...]:
        """``decode_attention_f32``'s arguments after the query (``attend_layer_f32`` ends
        with them too)."""
        _, kv_heads, cols, dim = keys.shape
        return (
            keys.data_ptr(),
            values.data_ptr(),
            self.rows.data_ptr(),
            self.lens.data_ptr(),
            out.data_ptr(),
            self.n,
            heads,
            kv_heads,
            cols,
            dim,
            float(scale),
            self._scores.data_ptr(),
            self.width,
        )

    def attend(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        cos: Tensor,
        sin_signed: Tensor,
        keys: Tensor,
        values: Tensor,
        scale: float,
        checked: bool = True,
    ) -> Tensor:
        """One layer from its projections: rotary embedding of ``query`` ``[n, H * D]`` and
        ``key`` ``[n, Hkv * D]`` (``x * cos + roll(x, D/2) * sin_signed``, ``cos`` and
        ``sin_signed`` ``[n, 1, D]``: ``direct_forward._rotary``), each row's key and
        ``value`` written at column ``lens[i] - 1`` of its arena row, then ``__call__``'s
        attention; all in one C call. The projections may be column slices of one fused
        output (rows strided, columns contiguous). The same bits as those steps in torch:
        the rotary's products and sum are IEEE operations in torch's order, the writes
        copies. Returns ``[n, H, D]``. ``checked=False``: the caller vouches for the
        dtypes, devices and layouts of the projections and the rotary (``direct_forward``:
        its own outputs); the shapes and the arenas are checked either way."""
        n, dim = self.n, keys.shape[-1]
        slots, kv_heads, cols, _ = keys.shape
        heads = query.shape[1] // dim if query.dim() == 2 else 0
        if keys.dtype != torch.float32 or values.dtype != torch.float32:
            raise ValueError(f"the arenas must be float32, got {keys.dtype}/{values.dtype}")
        if (
            query.shape != (n, heads * dim)
            or key.shape != (n, kv_heads * dim)
            or value.shape != key.shape
            or values.shape != keys.shape
            or cos.shape != (n, 1, dim)
            or sin_signed.shape != cos.shape
            or dim % 2
            or heads % kv_heads
        ):
            raise ValueError(
                f"projections {tuple(query.shape)}/{tuple(key.shape)}/{tuple(value.shape)} "
                f"and rotary {tuple(cos.shape)} do not fit {n} rows on the arena "
                f"{tuple(keys.shape)}"
            )
        if self.max_len > cols - 1:  # the last column is the cache's trash column
            raise ValueError(f"rows read {self.max_len} columns, the arena holds {cols - 1}")
        if checked:
            tensors = (query, key, value, cos, sin_signed)
            if any(not t.is_cpu or t.dtype != torch.float32 for t in tensors):
                raise ValueError("attend takes float32 tensors on the CPU")
            if any(t.stride(-1) != 1 for t in (query, key, value)) or not all(
                t.is_contiguous() for t in (cos, sin_signed)
            ):
                raise ValueError("rows must have contiguous columns, the rotary be contiguous")
        if not (keys.is_cpu and keys.is_contiguous() and values.is_contiguous()):
            raise ValueError("the arenas must be contiguous, on the CPU")
        q = self._query
        if q is None or q.shape[1] != heads * dim:
            q = self._query = torch.empty(n, heads * dim, dtype=torch.float32, device="cpu")
        out = torch.empty(n, heads, dim, dtype=torch.float32, device="cpu")
        self._layer(
            query.data_ptr(),
            query.stride(0),
            key.data_ptr(),
            key.stride(0),
            value.data_ptr(),
            value.stride(0),
            cos.data_ptr(),
            sin_signed.data_ptr(),
            q.data_ptr(),
            *self._attention_args(keys, values, out, heads, scale),
        )
        return out


ATEN_SUM_LANES = {"AVX512": 8, "AVX2": 8, "DEFAULT": 8}
"""Floats per vector in which ATen's float32 ``sum`` adds under each of its x86 CPU kernel
sets (the order ``add_rms_norm`` repeats); under AVX512 the sum runs the AVX2 kernel
(docs/measurements.md says how this was found)."""

RMS_MAX_DIM = 256
"""``add_rms_norm`` handles rows of at most this many floats: fewer than 64 vectors, so
ATen's cascade (``multi_row_sum``'s levels, from 64 vectors up) never starts, and the one
order to repeat is the plain one; wider rows cost a norm far more than its call overhead,
so torch's six operations stay there."""


def aten_lanes() -> int:
    """``ATEN_SUM_LANES`` of the kernels torch runs now (``ATEN_CPU_CAPABILITY`` or the
    CPU's best), 0 where not known (another architecture: ``add_rms_norm`` is not used)."""
    return ATEN_SUM_LANES.get(torch.backends.cpu.get_cpu_capability(), 0)


def add_rms_norm(
    a: Tensor,
    b: Tensor | None,
    weight: Tensor,
    eps: float,
    lanes: int,
    library: ctypes.CDLL | None = None,
    checked: bool = True,
) -> tuple[Tensor, Tensor]:
    """``h = a + b`` (``b`` None: ``h = a``) and ``LlamaRMSNorm(h)`` in one C call, bit for
    bit as torch computes them on the CPU in float32::

        h = a + b
        x = weight * (h * rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))

    The one order that is not an elementwise operation's, the sum inside ``mean``, is
    ATen's (``SumKernel.cpp``) for ``lanes``-float vectors (``aten_lanes()``); the rest are
    single IEEE operations in the order written. ``a``, ``b``: float32 ``[n, dim]``
    contiguous on the CPU, ``lanes <= dim <= RMS_MAX_DIM``. Returns ``(h, x)``: ``h`` is
    ``a`` when ``b`` is None. Replaces seven operations per norm (an add and the norm's six).
    ``checked=False``: the caller vouches for the dtypes, devices, layouts and ``lanes``
    (``direct_forward``: its own float32 rows); the shapes are checked either way (the C
    code trusts them)."""
    lib = library or _library()
    assert lib is not None, unavailable_reason()
    n, dim = a.shape
    if weight.shape != (dim,) or (b is not None and b.shape != a.shape):
        raise ValueError(
            f"add_rms_norm: {tuple(a.shape)} + {None if b is None else tuple(b.shape)}, "
            f"weight {tuple(weight.shape)}"
        )
    if checked:
        if lanes not in (8, 16) or not lanes <= dim <= RMS_MAX_DIM:
            raise ValueError(f"add_rms_norm: rows of {dim} (at most {RMS_MAX_DIM}), {lanes} lanes")
        tensors = (a, weight) if b is None else (a, b, weight)
        if any(not t.is_cpu or t.dtype != torch.float32 or not t.is_contiguous() for t in tensors):
            raise ValueError("add_rms_norm takes contiguous float32 tensors on the CPU")
    h = a if b is None else torch.empty(n, dim, dtype=torch.float32, device="cpu")
    x = torch.empty(n, dim, dtype=torch.float32, device="cpu")
    lib.add_rms_f32(
        a.data_ptr(),
        None if b is None else b.data_ptr(),
        h.data_ptr(),
        weight.data_ptr(),
        x.data_ptr(),
        n,
        dim,
        eps,
        lanes,
    )
    return h, x
