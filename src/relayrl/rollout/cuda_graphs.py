"""CUDA-graph capture and replay of the own engine's decode step.

On a GPU a decode step of the own engine is bound by the host, not the chip: the direct
forward of a 24-layer model launches ~800 small kernels, each with a fixed launch cost
(the H200 figures are in docs/gpu.md), while the same step replayed as a CUDA graph is one
launch. This module captures it.

What is captured, per graph: ONE decode step of ``B`` batch rows reading ``C`` KV columns,
from the token embedding to the fp32 logits of every row: the mask built from the positions,
rotary, per layer the norms, q/k/v, the key/value writes into the arenas, the split decode
attention (``split_attention.decode_attention``), the MLP, the final norm and the LM head
(``direct_forward.direct_logits``: the same operations as the eager step). Not captured: the
host-side choice of the graph, the one host -> device copy of the step's inputs into the
static buffers before the replay, the selection of the live rows' logits after it, and the
sampler (``sampler.sample`` runs eagerly on those logits: the same function, the same
math, a few kernels). Prefill steps (and steps that mix prefills with decode rows) stay
eager: ``ModelRunner`` takes this path only for decode-only steps.

Static addresses. A graph replays its kernels on the addresses it was captured with, so
everything it reads lives at a fixed place:

- the step inputs, one int64 buffer ``[max_batch, 3]``: per batch row its token id, its
  position, and the KV column it writes (= its position; the cache's trash column for a
  padding row); plus a constant ``arange`` of arena rows;
- the KV arenas (``SlotKVCache``): batch row ``r`` IS slot ``r`` (the graph for ``B`` covers
  arena rows ``[0, B)``, a zero-copy view), so no slot index is gathered: slots not in the
  step (free, being prefilled, of another weights version) are padding rows that write only
  to their trash column. The scheduler hands out the lowest free slot, so live slots stay
  packed at the front and ``B`` tracks the number of live rows;
- the weights, read in place: ``update_weights`` copies new values into the same tensors
  (``load_state_dict``), so the graphs stay valid and read the new values. A parameter or
  buffer REPLACED by a new tensor (``load_state_dict(assign=True)``, ``.to()``, ``p.data =``)
  moves: every step compares the addresses of the model's tensors with those at capture
  (``check_addresses``) and drops every graph on a change; new ones are captured as needed;
- the fp32 logits are written by the graph into one static buffer ``[max_batch, vocab]``.

Buckets. A step of live slots ``S`` runs the graph of the smallest capture size ``B >
max(S)`` (``capture_sizes``: powers of two and their 1.5x midpoints up to ``max_slots``, as
vLLM's and SGLang's capture lists, so padding costs at most a third) and of ``C`` KV
columns, the smallest power of two (at least ``min_kv_columns``) holding the longest live
sequence, capped at the arenas' capacity: attention reads ``C`` columns per row, masked per
row from its position, so ``C`` at most doubles the KV read of the eager step (which reads
the longest live length). Graphs are captured lazily, the first time a ``(B, C)`` is needed
(two eager warm-up runs on a side stream and the capture, all on padding rows that write
only to trash columns, so capturing never touches live KV), into ONE memory pool shared by
all of them (``torch.cuda.graph_pool_handle``): their intermediates reuse the same memory.
When the arenas move (the cache grows its capacity, or is released) every graph is dropped.
A capture synchronises the device (``torch.cuda.graph`` does) and costs about three eager
steps; a replay adds no synchronisation to the step's one device -> host transfer.

Numerics. A replay runs exactly the kernels of the static step run eagerly (``capture=False``:
the same buffers, padding and code, without the graph; the CPU tests run it), so graphs on and
off give the same logits there. Against the plain eager step (no padding, ``kv_len`` columns)
the matmuls see more rows and attention more (masked) columns: per row the same math, but a
GPU library may pick another kernel for another shape, so the bits of the last place may
differ (tokens almost never). The sampled tokens' behaviour logprobs are those of the
distribution they were drawn from either way.

Failure. A capture that fails (an operation that cannot be captured) turns graphs off for the
engine with the reason in ``stats()['cuda_graph_disabled']``; steps then run eagerly.
"""

from __future__ import annotations

import time
import weakref
from array import array
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import Tensor

from relayrl.rollout import direct_forward
from relayrl.rollout import split_attention as attention
from relayrl.rollout.kv_cache import SlotKVCache
from relayrl.rollout.transfer import device_tensor, model_dtype

MIN_KV_COLUMNS = 64
"""The fewest KV columns a graph reads (shorter steps pad their attention to this)."""

WARMUP_RUNS = 2
"""Eager runs of a step's shapes on a side stream before its capture (lazy library set-up,
such as cuBLAS workspaces, must not happen inside a capture)."""


def capture_sizes(max_slots: int) -> tuple[int, ...]:
    """Batch sizes graphs are captured for: ``1, 2, 4, 8`` then every power of two and its
    1.5x midpoint (``16, 24, 32, 48, ...``) below ``max_slots``, then ``max_slots``."""
    if max_slots <= 0:
        raise ValueError(f"max_slots must be > 0, got {max_slots}")
    sizes = {n for n in (1, 2, 4, 8) if n < max_slots}
    p = 16
    while p < max_slots:
        sizes.add(p)
        if p + p // 2 < max_slots:
            sizes.add(p + p // 2)
        p *= 2
    sizes.add(max_slots)
    return tuple(sorted(sizes))


def batch_bucket(rows_needed: int, sizes: Sequence[int]) -> int:
    """The smallest capture size holding ``rows_needed`` batch rows (``sizes`` ascending)."""
    for size in sizes:
        if size >= rows_needed:
            return size
    raise ValueError(f"{rows_needed} rows exceed the largest capture size {sizes[-1]}")


def kv_bucket(kv_len: int, capacity: int, min_columns: int = MIN_KV_COLUMNS) -> int:
    """KV columns a graph reads for a step whose longest row needs ``kv_len``: the smallest
    power of two ``>= max(kv_len, min_columns)``, capped at the arenas' ``capacity``."""
    if kv_len > capacity:
        raise ValueError(f"a step needs {kv_len} KV columns, the arenas hold {capacity}")
    columns = 1 << (max(kv_len, min_columns) - 1).bit_length()
    return min(columns, capacity)


def _tensor_slots(model: torch.nn.Module) -> list[tuple[dict[str, Any], str]]:
    """(dict, key) of every parameter and buffer of every module: where a replaced tensor
    would be found (``_parameters[name]``), read anew at each address check."""
    out: list[tuple[dict[str, Any], str]] = []
    for mod in model.modules():
        for store in (mod._parameters, mod._buffers):
            out.extend((store, name) for name, t in store.items() if t is not None)
    return out


class DecodeGraphs:
    """CUDA graphs of the decode step of one model on one KV cache, per ``(B, C)`` bucket.

    Args:
        model: the engine's model (its current weights). Steps of any other module (a copy
            kept for in-flight sequences of an older version) run eagerly.
        pad_token_id: the token of padding rows.
        max_slots: the KV cache's slots (the largest batch).
        device: where the model is.
        capture: True: CUDA graphs (CUDA only); False: the same static-buffer step run
            eagerly (any device; what the CPU tests check). Default: ``device`` is CUDA.
        sizes: batch sizes to capture (default ``capture_sizes(max_slots)``; ``max_slots``
            is added).
        min_kv_columns: the fewest KV columns a graph reads.
        check_addresses: compare the model's tensor addresses with the captured ones at
            every step (one pointer comparison a tensor); off, a replaced weight tensor goes
            unseen until ``weights_updated`` or ``invalidate``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        pad_token_id: int,
        max_slots: int,
        device: torch.device | str,
        *,
        capture: bool | None = None,
        sizes: Sequence[int] | None = None,
        min_kv_columns: int = MIN_KV_COLUMNS,
        check_addresses: bool = True,
    ) -> None:
        self.device = torch.device(device)
        self.capture = self.device.type == "cuda" if capture is None else capture
        if self.capture and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the model is on {self.device}")
        self.pad_token_id = pad_token_id
        self.max_slots = max_slots
        chosen = set(capture_sizes(max_slots) if sizes is None else sizes)
        if any(s <= 0 or s > max_slots for s in chosen):
            raise ValueError(f"capture sizes must be in [1, {max_slots}], got {sorted(chosen)}")
        self.sizes = tuple(sorted(chosen | {max_slots}))
        self.min_kv_columns = min_kv_columns
        self.check_addresses = check_addresses
        self._model = weakref.ref(model)
        self._tensors = _tensor_slots(model)
        self._cache: weakref.ref[SlotKVCache] | None = None
        self._cache_layout = -1
        self._addresses: tuple[int, ...] = ()
        # (B, C) -> its graph (None when ``capture`` is False: the shapes are set up)
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph | None] = {}
        self._pool: Any = None
        self._inputs: Tensor | None = None  # int64 [max_batch, 3]: id, position, write column
        self._rows: Tensor | None = None  # int64 [max_batch, 1]: arena row of each batch row
        self._logits: Tensor | None = None  # fp32 [max_batch, vocab]
        self._no_mask: Tensor | None = None
        self.disabled: str | None = None  # why graphs were turned off (a failed capture)
        self.counts = {"captures": 0, "replays": 0, "invalidations": 0, "eager_steps": 0}
        self.capture_s = 0.0

    # ------------------------------------------------------------------ public
    def run(
        self,
        model: torch.nn.Module,
        cache: SlotKVCache,
        slots: Sequence[int],
        starts: Sequence[int],
        tokens: Sequence[Sequence[int]],
    ) -> Tensor | None:
        """fp32 logits ``[len(slots), vocab]`` of one decode step (``tokens[i]`` is one token
        of the sequence in ``slots[i]``, at position ``starts[i]``), by replaying its graph
        (``capture``) or running the static step eagerly; None when this step is not for
        graphs (another model, graphs disabled): the caller runs it eagerly. The returned
        rows may be a view of the static logits buffer, valid until the next step."""
        if self.disabled is not None or model is not self._model():
            return None
        with torch.inference_mode():
            return self._run(model, cache, slots, starts, tokens)

    def weights_updated(self) -> None:
        """Called after the engine loaded new weights: graphs stay valid when the weights
        were copied in place (the usual case), and are dropped when a tensor moved."""
        model = self._model()
        if model is None:
            return
        self._tensors = _tensor_slots(model)  # a new submodule or tensor name, if any
        if self._graphs and self._current_addresses() != self._addresses:
            self.invalidate()

    def invalidate(self) -> None:
        """Drop every graph (and the pool's memory with them) and the static buffers; new
        ones are made when needed. For a caller that replaced the model's tensors with
        ``check_addresses`` off."""
        if self._graphs:
            self.counts["invalidations"] += 1
        self._graphs.clear()
        self._pool = None
        self._inputs = None  # remade for the model as it is now (its dtype, vocabulary)

    def stats(self) -> dict[str, Any]:
        """Counters (``cuda_graph_*``): graphs held, captures (shapes set up when not
        capturing), replays, eager static steps, invalidations, capture seconds, and why
        graphs are off, if they are."""
        out: dict[str, Any] = {f"cuda_graph_{k}": v for k, v in self.counts.items()}
        out["cuda_graph_mode"] = "capture" if self.capture else "eager"
        out["cuda_graphs_held"] = len(self._graphs)
        out["cuda_graph_capture_s"] = round(self.capture_s, 4)
        out["cuda_graph_disabled"] = self.disabled
        return out

    # ------------------------------------------------------------------ internals
    def _current_addresses(self) -> tuple[int, ...]:
        return tuple(store[name].data_ptr() for store, name in self._tensors)

    def _bind(self, cache: SlotKVCache) -> None:
        """Drop the graphs when the cache, its arenas or the weights' addresses changed
        since they were captured."""
        bound = self._cache() if self._cache is not None else None
        layout = cache.layout_version
        addresses = self._current_addresses() if self.check_addresses or not self._graphs else None
        stale = bound is not cache or layout != self._cache_layout
        if addresses is not None and addresses != self._addresses:
            stale = True
        if stale:
            self.invalidate()
            self._cache = weakref.ref(cache)
            self._cache_layout = layout
            self._addresses = addresses if addresses is not None else self._current_addresses()

    def _buffers(self, vocab: int, dtype: torch.dtype) -> None:
        """The static buffers, made once (outside any graph pool)."""
        if self._inputs is not None:
            return
        n, dev = self.sizes[-1], self.device
        self._inputs = torch.zeros(n, 3, dtype=torch.long, device=dev)
        self._rows = torch.arange(n, dtype=torch.long, device=dev).unsqueeze(1)
        self._logits = torch.zeros(n, vocab, dtype=torch.float32, device=dev)
        self._no_mask = torch.zeros(1, 1, 1, 1, dtype=dtype, device=dev)  # masks: the state

    def _fill(
        self,
        batch: int,
        trash: int,
        slots: Sequence[int],
        starts: Sequence[int],
        tokens: Sequence[Sequence[int]],
    ) -> None:
        """Copy the step's inputs into the static buffer (one host -> device copy): batch
        row ``slots[i]`` gets ``tokens[i]`` at ``starts[i]``; every other row is padding
        (the pad token at position 0, writing to the ``trash`` column)."""
        ids = array("q", [self.pad_token_id]) * batch
        pos = array("q", [0]) * batch
        cols = array("q", [trash]) * batch
        for slot, start, toks in zip(slots, starts, tokens, strict=True):
            ids[slot], pos[slot], cols[slot] = toks[0], start, start
        flat = array("q", bytes(24 * batch))
        flat[0::3], flat[1::3], flat[2::3] = ids, pos, cols
        host = torch.frombuffer(flat, dtype=torch.int64).view(batch, 3)
        assert self._inputs is not None
        self._inputs[:batch].copy_(host, non_blocking=True)

    def _step(self, model: torch.nn.Module, cache: SlotKVCache, batch: int, columns: int) -> None:
        """The static decode step of ``batch`` rows on ``columns`` KV columns: what a graph
        captures (and what ``capture=False`` runs). Reads only the static buffers, the arenas
        and the weights; writes the arenas and ``_logits[:batch]``."""
        assert self._inputs is not None and self._rows is not None and self._logits is not None
        ids, pos, cols = self._inputs[:batch].unbind(1)
        cache.plan(
            slice(0, 0),  # the reads are the one bucket below
            self._rows[:batch],
            cols.view(batch, 1),  # padding rows: the trash column already
            columns,
            buckets=[(slice(0, batch), columns)],
            padded=False,
        )
        mask = attention.causal_mask(pos.view(batch, 1, 1), columns, model_dtype(model))
        attention.ACTIVE.state = attention.SplitState(cache, batch, [(0, batch, mask)], None)
        try:
            direct_forward.direct_logits(
                model,
                ids,
                pos,
                cache,
                attention.split_attention,
                self._no_mask,
                logits_out=self._logits[:batch],
            )
        finally:
            attention.ACTIVE.state = None

    def _capture(
        self, model: torch.nn.Module, cache: SlotKVCache, batch: int, columns: int
    ) -> torch.cuda.CUDAGraph | None:
        """Set up ``(batch, columns)``: capture its graph (warm-up and capture on padding
        rows only: no live KV is written), or nothing to do when not capturing."""
        t0 = time.perf_counter()
        self.counts["captures"] += 1
        if not self.capture:
            return None
        self._fill(batch, cache.capacity, [], [], [])
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                self._step(model, cache, batch, columns)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA work (a trainer next to the engine) goes on
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            self._step(model, cache, batch, columns)
        self.capture_s += time.perf_counter() - t0
        return graph

    def _run(
        self,
        model: torch.nn.Module,
        cache: SlotKVCache,
        slots: Sequence[int],
        starts: Sequence[int],
        tokens: Sequence[Sequence[int]],
    ) -> Tensor | None:
        kv_len = max(starts) + 1
        cache.ensure_capacity(kv_len)  # may move the arenas: before the binding check
        self._bind(cache)
        batch = batch_bucket(max(slots) + 1, self.sizes)
        columns = kv_bucket(kv_len, cache.capacity, self.min_kv_columns)
        vocab = int(cast(Any, model).get_output_embeddings().out_features)
        self._buffers(vocab, model_dtype(model))
        key = (batch, columns)
        if key not in self._graphs:
            try:
                self._graphs[key] = self._capture(model, cache, batch, columns)
            except Exception as e:  # noqa: BLE001 - graphs off, the step runs eagerly
                self.disabled = f"capture of {key} failed: {type(e).__name__}: {e}"[:500]
                self.invalidate()
                return None
        self._fill(batch, cache.capacity, slots, starts, tokens)
        graph = self._graphs[key]
        if graph is None:
            self._step(model, cache, batch, columns)
            self.counts["eager_steps"] += 1
        else:
            graph.replay()
            self.counts["replays"] += 1
        assert self._logits is not None
        lo, hi = slots[0], slots[-1] + 1
        if hi - lo == len(slots):  # contiguous slots: a view, no copy
            return self._logits[lo:hi]
        return self._logits.index_select(0, device_tensor(list(slots), torch.long, self.device))
