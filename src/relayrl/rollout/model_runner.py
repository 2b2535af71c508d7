"""Batched prefill + decode steps of a Hugging Face causal LM on the per-slot KV cache.

One step runs one forward over a set of sequences, each feeding its not-yet-computed tokens
(a whole prompt for a fresh request, prompt + tokens so far after an interrupt, one token
when decoding). Rows are right-aligned in a ``[n, q]`` window: row ``r`` with ``q_r`` new
tokens occupies the last ``q_r`` columns, so the last column is every row's last token and the
LM head runs on that column only (``logits_to_keep=1``). Leading pad columns get the position
of the row's first new token, attend to a valid prefix (no NaN) and write their keys to the
cache's trash column; their outputs are ignored.

Positions are explicit (``start + i``), and the 4D additive mask allows row ``r``, new token
``i`` to see cache columns ``j <= start_r + i``: the exact causal context of that sequence,
independent of what else is in the batch.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
from torch import Tensor

from relayrl.rollout.kv_cache import SlotKVCache


class ModelRunner:
    """Runs forwards for the engine; stateless apart from a few cached tensors."""

    def __init__(self, pad_token_id: int, max_slots: int, dense_fraction: float = 0.5) -> None:
        self.pad_token_id = pad_token_id
        self.max_slots = max_slots
        # A contiguous slot range is run as a zero-copy view when at least this fraction of
        # its rows is real work; otherwise the rows are gathered.
        self.dense_fraction = dense_fraction
        self._signatures: dict[type, tuple[str, bool]] = {}

    def _signature(self, model: torch.nn.Module) -> tuple[str, bool]:
        """(name of the cache argument, whether ``logits_to_keep`` is accepted)."""
        key = type(model)
        if key not in self._signatures:
            params = inspect.signature(model.forward).parameters
            cache_arg = "cache" if "cache" in params else "past_key_values"
            self._signatures[key] = (cache_arg, "logits_to_keep" in params)
        return self._signatures[key]

    def choose_rows(
        self, slots: Sequence[int], cache: SlotKVCache
    ) -> tuple[Tensor | slice, list[int]]:
        """Pick the arena rows of a forward over ``slots`` (sorted).

        Returns the row selector and, per row, the index into ``slots`` (``-1`` for a dummy
        row: a free slot inside a contiguous range).
        """
        lo, hi = slots[0], slots[-1] + 1
        span = hi - lo
        if span == len(slots):
            return slice(lo, hi), list(range(len(slots)))
        if len(slots) >= self.dense_fraction * span:
            member = {s: i for i, s in enumerate(slots)}
            if all(s in member or cache.is_free(s) for s in range(lo, hi)):
                return slice(lo, hi), [member.get(s, -1) for s in range(lo, hi)]
        return torch.tensor(list(slots), dtype=torch.long), list(range(len(slots)))

    def execute(
        self,
        model: torch.nn.Module,
        cache: SlotKVCache,
        slots: Sequence[int],
        starts: Sequence[int],
        new_tokens: Sequence[Sequence[int]],
    ) -> Tensor:
        """One forward. Returns fp32 logits ``[len(slots), vocab]`` of each row's last token.

        ``slots`` must be sorted ascending; ``starts[i]`` is how many tokens of sequence ``i``
        are already in its slot's cache, ``new_tokens[i]`` the tokens to compute now (>= 1).
        """
        rows, row_map = self.choose_rows(slots, cache)
        n = len(row_map)
        q = max(len(t) for t in new_tokens)
        ids = [[self.pad_token_id] * q for _ in range(n)]
        start_col = [0] * n  # for dummies: start 0, every column padding
        num_new = [0] * n
        for r, i in enumerate(row_map):
            if i < 0:
                continue
            toks = new_tokens[i]
            ids[r][q - len(toks) :] = toks
            start_col[r] = starts[i]
            num_new[r] = len(toks)
        input_ids = torch.tensor(ids, dtype=torch.long)
        start = torch.tensor(start_col, dtype=torch.long).unsqueeze(1)  # [n, 1]
        k = torch.tensor(num_new, dtype=torch.long).unsqueeze(1)  # [n, 1]
        col = torch.arange(q, dtype=torch.long).unsqueeze(0)  # [1, q]
        i = col - (q - k)  # index of the new token in its row; < 0 on padding
        position_ids = start + i.clamp(min=0)  # [n, q]
        write_pos = torch.where(i >= 0, position_ids, -1)
        kv_len = max(s + t for s, t in zip(start_col, num_new, strict=True))
        kv_len = max(kv_len, 1)
        cache.plan(rows, write_pos, kv_len)
        dtype = next(model.parameters()).dtype
        allowed = torch.arange(kv_len).view(1, 1, kv_len) <= position_ids.unsqueeze(2)
        mask = torch.zeros(n, 1, q, kv_len, dtype=dtype)
        mask.masked_fill_(~allowed.unsqueeze(1), torch.finfo(dtype).min)
        cache_arg, keeps_logits = self._signature(model)
        kwargs: dict[str, object] = {cache_arg: cache}
        if keeps_logits:
            kwargs["logits_to_keep"] = 1
        out = model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=position_ids,
            use_cache=True,
            **kwargs,
        )
        logits = out.logits[:, -1].float()
        if isinstance(rows, slice) and n != len(slots):
            keep = torch.tensor([r for r, i in enumerate(row_map) if i >= 0], dtype=torch.long)
            logits = logits.index_select(0, keep)
        return logits
