"""Per-slot KV cache: one row of a preallocated arena per slot, freed and reused on completion.

Layout. For every attention layer the cache holds one key and one value arena of shape
``[num_slots, kv_heads, capacity + 1, head_dim]``. Slot ``s`` owns row ``s``; its first
``length[s]`` columns hold the keys/values of the tokens computed so far. The last column
(index ``capacity``) is a trash column: padded query positions of a step write there and no
mask ever reads it, so padding never touches live data.

- No padding to the longest sequence: each slot has its own length, a finished slot is handed
  to the next request at once (its length is reset to 0, nothing is cleared or copied), and no
  sequence waits for another. A step's attention reads only the columns up to the longest
  live length *in that step* and masks the rest per row.
- Capacity grows geometrically (x2, capped at ``max_len``) when a step needs more columns, so
  memory tracks the longest live sequence rather than the model's context length.
- A forward runs either on a contiguous range of slots (the arena rows are a view: zero copy;
  free slots inside the range are dummy rows whose writes go to the trash column) or on an
  arbitrary list of slots (rows are gathered: one copy per layer). See :meth:`plan`.
- The arenas live on the model's device (made from a layer's first keys); the slot table and
  lengths are Python, on the host.

It implements the ``transformers`` ``Cache`` protocol (``update(key, value, layer_idx)``), so
any Hugging Face causal LM that routes its attention through ``cache.update`` and accepts a
prepared 4D attention mask runs on it unchanged.
"""

from __future__ import annotations

import heapq

import torch
from torch import Tensor
from transformers.cache_utils import Cache


class SlotKVCache(Cache):
    """KV storage for ``num_slots`` concurrent sequences of at most ``max_len`` tokens each."""

    def __init__(
        self,
        num_slots: int,
        max_len: int,
        initial_capacity: int = 128,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__(layers=[])
        if num_slots <= 0:
            raise ValueError(f"num_slots must be > 0, got {num_slots}")
        self.num_slots = num_slots
        self.max_len = max_len
        self.capacity = max(1, min(initial_capacity, max_len))
        # where the arenas live: the model's device (an arena is made from a layer's first
        # keys, ``new_zeros``, so it follows the model whatever this says)
        self.device = torch.device(device)
        self._keys: list[Tensor | None] = []
        self._values: list[Tensor | None] = []
        self._free: list[int] = list(range(num_slots))  # min-heap: lowest free slot first
        self._is_free = [True] * num_slots
        # The plan of the forward in flight (set by ``plan``, read by ``update``).
        self._rows: Tensor | slice = slice(0, 0)
        self._write_rows: Tensor = torch.zeros(0, 1, dtype=torch.long, device=self.device)
        self._write_pos: Tensor = torch.zeros(0, 1, dtype=torch.long, device=self.device)
        self._kv_len = 0
        self._buckets: list[tuple[Tensor | slice, int]] | None = None
        self.split_buckets: list[tuple[Tensor, Tensor]] | None = None
        self.split_arenas: tuple[Tensor, Tensor] | None = None
        # bumped whenever an arena is made, replaced (growth) or dropped: what a captured
        # CUDA graph of a step read is then gone (``relayrl.rollout.cuda_graphs``)
        self.layout_version = 0

    # ----------------------------------------------------------------- slot table
    def allocate(self) -> int:
        """Take the lowest free slot (keeps live slots packed at the front)."""
        if not self._free:
            raise RuntimeError("no free KV slot")
        slot = heapq.heappop(self._free)
        self._is_free[slot] = False
        return slot

    def free(self, slot: int) -> None:
        """Give a slot back; its stale contents are simply overwritten by the next owner."""
        if self._is_free[slot]:
            raise RuntimeError(f"slot {slot} freed twice")
        self._is_free[slot] = True
        heapq.heappush(self._free, slot)

    def is_free(self, slot: int) -> bool:
        return self._is_free[slot]

    @property
    def num_free(self) -> int:
        return len(self._free)

    # ----------------------------------------------------------------- one forward
    def plan(
        self,
        rows: Tensor | slice,
        write_rows: Tensor,
        write_pos: Tensor,
        kv_len: int,
        buckets: list[tuple[Tensor | slice, int]] | None = None,
        padded: bool = True,
    ) -> None:
        """Prepare the next forward.

        ``write_rows`` ``[n, 1]`` and ``write_pos`` ``[n, q]`` give the arena row and column of
        each new key/value of the batch (column ``-1`` = trash column). ``rows`` selects the
        arena rows attention reads (a slice = zero-copy view), ``kv_len`` how many columns.

        Without ``buckets``: ``update`` returns those rows (one per batch row). With
        ``buckets`` (the runner's split attention): ``update`` returns the new keys/values
        unchanged and leaves one read per bucket ``(rows, columns)`` in :attr:`split_buckets`
        for the decode part of attention (``rows`` is then unused), so that a short sequence
        decoded next to a long one reads its own length, not the long one's. Grows the arenas
        when needed. ``padded=False``: the caller says no column is ``-1`` (no trash writes
        to redirect).
        """
        self.ensure_capacity(kv_len)
        self._rows = rows
        self._write_rows = write_rows
        self._write_pos = (
            torch.where(write_pos < 0, self.capacity, write_pos) if padded else write_pos
        )
        self._kv_len = kv_len
        self._buckets = buckets
        self.split_buckets = None

    def ensure_capacity(self, columns: int) -> None:
        """Grow the arenas (x2 steps) to hold ``columns`` tokens; a step that would leave
        less than another doubling to ``max_len`` goes to ``max_len`` at once (one copy of the
        arenas instead of two, at most 2x the columns in use either way)."""
        if columns > self.max_len:
            raise ValueError(f"step needs {columns} KV columns, max_len is {self.max_len}")
        if columns > self.capacity:
            new_cap = self.capacity
            while new_cap < columns:
                new_cap *= 2
            if 2 * new_cap > self.max_len:
                new_cap = self.max_len
            self._grow(new_cap)

    def _grow(self, new_cap: int) -> None:
        for arenas in (self._keys, self._values):
            for i, old in enumerate(arenas):
                if old is None:
                    continue
                s, h, _, d = old.shape
                new = old.new_zeros(s, h, new_cap + 1, d)
                new[:, :, : self.capacity] = old[:, :, : self.capacity]
                arenas[i] = new
        self.capacity = new_cap
        self.layout_version += 1

    def update(
        self,
        key_states: Tensor,
        value_states: Tensor,
        layer_idx: int,
        *args: object,
        **kwargs: object,
    ) -> tuple[Tensor, Tensor]:
        """Write this step's keys/values into their slots and return what attention reads."""
        _, heads, _, dim = key_states.shape
        keys, values = self.arenas(layer_idx, heads, dim, key_states, value_states.shape[-1])
        # [S, L, H, D] views of the arenas so that one index_put writes [n, q, H, D].
        rows, pos = self._write_rows, self._write_pos
        keys.permute(0, 2, 1, 3)[rows, pos] = key_states.transpose(1, 2).to(keys.dtype)
        values.permute(0, 2, 1, 3)[rows, pos] = value_states.transpose(1, 2).to(values.dtype)
        if self._buckets is not None:
            self.split_arenas = (keys, values)  # this layer's, for ``varlen_decode``
            self.split_buckets = [
                (read_rows(keys, sel, cols), read_rows(values, sel, cols))
                for sel, cols in self._buckets
            ]
            return key_states, value_states
        n = self._kv_len
        return read_rows(keys, self._rows, n), read_rows(values, self._rows, n)

    def arenas(
        self, layer_idx: int, heads: int, dim: int, like: Tensor, value_dim: int | None = None
    ) -> tuple[Tensor, Tensor]:
        """The layer's key and value arenas ``[S, heads, C + 1, dim]`` (values:
        ``value_dim``, default ``dim``), made on first use: zeros of ``like``'s dtype and
        device. Also for a caller that writes them itself (``varlen_decode.Rows.attend``:
        the planned rows and columns, one token per batch row)."""
        while len(self._keys) <= layer_idx:
            self._keys.append(None)
            self._values.append(None)
        keys, values = self._keys[layer_idx], self._values[layer_idx]
        if keys is None or values is None:
            shape = (self.num_slots, heads, self.capacity + 1, dim)
            keys = like.new_zeros(shape)
            values = like.new_zeros(shape[:3] + (value_dim or dim,))
            self._keys[layer_idx], self._values[layer_idx] = keys, values
            self.layout_version += 1
        return keys, values

    # ----------------------------------------------------------------- HF Cache protocol
    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Only used by models when position ids are not given; the engine always gives them."""
        return self._kv_len

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self._kv_len, 0

    def memory_bytes(self) -> int:
        """Bytes held by the arenas."""
        return sum(t.numel() * t.element_size() for t in self._keys + self._values if t is not None)

    def release(self) -> None:
        """Drop the arenas (e.g. when idle); they are re-created lazily on the next forward."""
        self._keys, self._values = [], []
        self.layout_version += 1


def read_rows(arena: Tensor, rows: Tensor | slice, columns: int) -> Tensor:
    """The first ``columns`` columns of arena ``rows``: a view for a slice, else a gather.

    The gather is ``index_select`` on the column-sliced view (one strided copy of exactly the
    rows and columns read), faster on the CPU than advanced indexing
    ``arena[rows, :, :columns]`` (docs/measurements.md); the same values.
    """
    if isinstance(rows, slice):
        return arena[rows, :, :columns]
    return arena[:, :, :columns].index_select(0, rows)
