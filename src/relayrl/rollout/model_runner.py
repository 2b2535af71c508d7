"""Batched prefill + decode steps of a Hugging Face causal LM on the per-slot KV cache.

A step computes, for a set of sequences, their not-yet-computed tokens (the whole prompt for
a fresh request, prompt + tokens so far after an interrupt, one token when decoding) and
returns the logits of each sequence's last token. Positions are always explicit, so a
sequence's logits never depend on what else shares the batch.

Two ways to run a step:

- **Split attention** (the fast path, used when the model passes a self-check at first use):
  one forward whose batch rows each hold ONE token: first the decode rows (one per live slot
  in a contiguous range, so attention reads a zero-copy view of the arena), then every
  prefill token, flat. The model's linear layers see ``n_decode + n_prefill_tokens`` rows
  with no padding. Attention is split (``relayrl.rollout.split_attention``, a
  ``transformers`` attention function swapped in for the duration of the forward): decode
  rows attend to their slot's cache, prefill tokens attend causally within their own prompt
  (a block-diagonal mask, or a call per prompt; a prefill always starts from an empty slot).
  On CPU, where per-forward overhead dominates small models, this makes a step with
  admissions cost about as much as a plain decode step instead of several times more. Decode
  rows of very different lengths (fresh short answers next to a long straggler, the normal
  state of continuous batching under a heavy tail) are grouped in length buckets (powers of
  two, merged while merging is cheaper than another attention call), each reading only its
  own columns of the cache: without them every row would read, and attend over, as many
  columns as the longest sequence. In float32 on the CPU no row needs any of this:
  ``cpu_kernels.varlen_decode`` walks each row's own columns of the arena in one call per layer,
  the prompt tokens too (token ``t`` of a prompt reads its slot's columns ``0 .. t``, written by
  ``cache.update`` just before attention): no gathers, masks, buckets or per-prompt calls, a step's
  attention is one call per layer whatever it holds (``varlen_decode=False`` turns it off). For
  Llama, Qwen2 and Mistral models the split forward runs without ``nn.Module`` calls
  (``relayrl.rollout.direct_forward``, bitwise the same logits, checked at first use; off:
  ``direct=False``); on CUDA, decode steps replay CUDA graphs.
- **Padded** (the fallback, any model whose attention goes through ``cache.update`` and a 4D
  mask): rows right-aligned in an ``[n, q]`` window, the last column is every row's last
  token, leading pad columns write to the cache's trash column. Decode rows and prefills run
  as two forwards so decode rows are never padded to the prompt width.

Device: every tensor of a step (ids, positions, write rows, masks, row selections) is made on
the model's ``device`` by non-blocking copies (``relayrl.rollout.transfer``); none comes back.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Sequence
from typing import cast

import torch
from torch import Tensor
from transformers import PreTrainedModel

from relayrl.rollout import direct_forward
from relayrl.rollout import split_attention as attention
from relayrl.rollout.cpu_kernels import varlen_decode
from relayrl.rollout.cuda_graphs import DecodeGraphs
from relayrl.rollout.kv_cache import SlotKVCache
from relayrl.rollout.transfer import CPU, device_rows, device_tensor, model_dtype, select_slots


class ModelRunner:
    """Runs forwards for the engine."""

    def __init__(
        self,
        pad_token_id: int,
        max_slots: int,
        max_prefill_tokens: int = 512,
        dense_fraction: float = 0.5,
        split_attention: bool = True,
        bucket_overhead: int = 4096,
        bucket_min_len: int = 32,
        prefill_call_cost: int = 2048,
        direct: bool = True,
        varlen_decode: bool = True,
        device: torch.device | str = "cpu",
        graphs: DecodeGraphs | None = None,
    ) -> None:
        self.pad_token_id = pad_token_id
        self.device = torch.device(device)  # the model's: every step tensor is made there
        self.max_slots = max_slots
        # Prefill tokens per split forward (the block-diagonal mask is P x P).
        self.max_prefill_tokens = max_prefill_tokens
        # A contiguous range of distinct slots runs as a zero-copy view of the arena when at
        # least this fraction of its rows is real work; otherwise rows are gathered.
        self.dense_fraction = dense_fraction
        self.split_attention = split_attention
        # What one more decode length bucket costs (a gather and an attention call per layer),
        # in cache row-columns read: buckets are merged while merging reads fewer extra.
        # 0 turns bucketing off.
        self.bucket_overhead = bucket_overhead
        self.bucket_min_len = bucket_min_len  # the shortest class: lengths <= this
        # one more prefill attention call's cost, in query-key pairs (``_prompt_by_prompt``)
        self.prefill_call_cost = prefill_call_cost
        # split forwards through ``direct_forward`` (no module calls; off: RELAYRL_DIRECT_FORWARD=0)
        self.direct = direct and os.environ.get("RELAYRL_DIRECT_FORWARD", "1") != "0"
        # decode rows through ``varlen_decode`` (float32 on the CPU, when its kernel builds):
        # each row reads its own cache length, no buckets, no gathers, no masks; decode-only
        # direct steps through CUDA graphs when ``graphs`` (``relayrl.rollout.cuda_graphs``)
        self.varlen_decode, self.graphs = varlen_decode, graphs
        self.num_forwards = 0
        self._signatures: dict[type, tuple[str, bool]] = {}
        self._split_ok: dict[type, bool] = {}
        self._direct_ok: dict[type, bool] = {}
        self._force_direct: bool | None = None  # set during _check_direct

    # ------------------------------------------------------------------ public
    def execute(
        self,
        model: PreTrainedModel,
        cache: SlotKVCache,
        slots: Sequence[int],
        starts: Sequence[int],
        new_tokens: Sequence[Sequence[int]],
    ) -> Tensor:
        """Compute the new tokens of each sequence; fp32 logits ``[len(slots), vocab]`` of
        each sequence's last token.

        ``slots`` are distinct and sorted; ``starts[i]`` is how many tokens of sequence ``i``
        are in its slot already, ``new_tokens[i]`` the tokens to compute now (>= 1).
        """
        decode = [i for i, t in enumerate(new_tokens) if len(t) == 1]
        prefill = [i for i, t in enumerate(new_tokens) if len(t) > 1]
        use_split = (
            self.split_attention
            and all(starts[i] == 0 for i in prefill)
            and self.supports_split(model)
        )
        if not prefill:
            if use_split and self.graphs is not None and self._use_direct(model):
                logits = self.graphs.run(model, cache, slots, starts, new_tokens)
                if logits is not None:  # None: not for graphs (another model): eager
                    self.num_forwards += 1
                    return logits
            if use_split:  # identical numerics to the steps with admissions
                return self._forward_split(model, cache, slots, starts, new_tokens, [], [])
            return self._forward_padded(model, cache, slots, starts, new_tokens)
        out: Tensor | None = None
        pieces: list[tuple[list[int], Tensor]] = []
        if use_split:
            chunks = self._chunk(prefill, new_tokens)
            for c, chunk in enumerate(chunks):
                dec = decode if c == 0 else []
                order = None  # one forward: its logits come out in the callers' order
                if len(chunks) == 1:
                    where = {i: j for j, i in enumerate(decode + prefill)}
                    order = [where[i] for i in range(len(slots))]
                logits = self._forward_split(
                    model,
                    cache,
                    [slots[i] for i in dec],
                    [starts[i] for i in dec],
                    [new_tokens[i] for i in dec],
                    [slots[i] for i in chunk],
                    [new_tokens[i] for i in chunk],
                    order=order,
                )
                if order is not None:
                    return logits
                pieces.append((dec + chunk, logits))
        else:
            for idx in (decode, prefill):
                if idx:
                    logits = self._forward_padded(
                        model,
                        cache,
                        [slots[i] for i in idx],
                        [starts[i] for i in idx],
                        [new_tokens[i] for i in idx],
                    )
                    pieces.append((idx, logits))
        for idx, logits in pieces:
            if out is None:
                out = logits.new_empty(len(slots), logits.shape[1])
            out.index_copy_(0, device_tensor(idx, torch.long, self.device), logits)
        assert out is not None
        return out

    def supports_split(self, model: PreTrainedModel) -> bool:
        """Whether split attention gives this model's exact results (checked once per class)."""
        key = type(model)
        if key not in self._split_ok:
            self._split_ok[key] = self._check_split(model)
        return self._split_ok[key]

    # ------------------------------------------------------------------ internals
    def _chunk(self, prefill: list[int], new_tokens: Sequence[Sequence[int]]) -> list[list[int]]:
        chunks: list[list[int]] = [[]]
        used = 0
        for i in prefill:
            n = len(new_tokens[i])
            if chunks[-1] and used + n > self.max_prefill_tokens:
                chunks.append([])
                used = 0
            chunks[-1].append(i)
            used += n
        return chunks

    def _signature(self, model: PreTrainedModel) -> tuple[str, bool]:
        """(name of the cache argument, whether ``logits_to_keep`` is accepted)."""
        key = type(model)
        if key not in self._signatures:
            params = inspect.signature(model.forward).parameters
            cache_arg = "cache" if "cache" in params else "past_key_values"
            self._signatures[key] = (cache_arg, "logits_to_keep" in params)
        return self._signatures[key]

    def _choose_rows(self, slots: Sequence[int]) -> tuple[Tensor | slice, list[int], list[int]]:
        """Arena rows of a forward over distinct sorted ``slots``.

        Returns the read selector, per batch row the index into ``slots`` (``-1`` = dummy
        row: an idle or prefilling slot inside a contiguous range, all its writes go to the
        trash column) and the arena row of each batch row (a host list).
        """
        lo, hi = slots[0], slots[-1] + 1
        span = hi - lo
        if span == len(slots):
            return slice(lo, hi), list(range(len(slots))), list(range(lo, hi))
        if len(slots) >= self.dense_fraction * span:
            member = {s: i for i, s in enumerate(slots)}
            row_map = [member.get(s, -1) for s in range(lo, hi)]
            return slice(lo, hi), row_map, list(range(lo, hi))
        rows = list(slots)
        return device_tensor(rows, torch.long, self.device), list(range(len(slots))), rows

    def _call(
        self, model: PreTrainedModel, cache: SlotKVCache, ids: Tensor, pos: Tensor, mask: Tensor
    ) -> Tensor:
        cache_arg, keeps_logits = self._signature(model)
        kwargs: dict[str, object] = {cache_arg: cache}
        if keeps_logits:
            kwargs["logits_to_keep"] = 1
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **kwargs)
        self.num_forwards += 1
        return out.logits[:, -1].float()

    def _call_rows(
        self,
        model: PreTrainedModel,
        cache: SlotKVCache,
        ids: Tensor,
        pos: Tensor,
        mask: Tensor,
        rows: Tensor | None,
    ) -> Tensor:
        """fp32 logits of batch ``rows`` (None: all) of a split forward ``[N, 1]`` through the
        model's modules: the base model, then the LM head on those rows only (``model(...)``
        would project every row, every prompt token of a prefill: ``[N, vocab]``, tens of GB
        at a 150k vocabulary and a few thousand prompt tokens). Models without a separate
        base and head go through ``_call`` and a row selection."""
        base, head = getattr(model, "base_model", model), model.get_output_embeddings()
        if base is model or head is None:
            logits = self._call(model, cache, ids, pos, mask)
            return logits if rows is None else logits.index_select(0, rows)
        cache_arg, _ = self._signature(base)
        out = base(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            use_cache=True,
            **{cache_arg: cache},
        )
        self.num_forwards += 1
        h = out.last_hidden_state[:, -1]
        return head(h if rows is None else h.index_select(0, rows)).float()

    def _forward_padded(
        self,
        model: PreTrainedModel,
        cache: SlotKVCache,
        slots: Sequence[int],
        starts: Sequence[int],
        new_tokens: Sequence[Sequence[int]],
    ) -> Tensor:
        """One forward over rows right-aligned in an ``[n, q]`` window."""
        dev = self.device
        rows, row_map, arena_rows = self._choose_rows(slots)
        n = len(row_map)
        q = max(len(t) for t in new_tokens)
        ids = [[self.pad_token_id] * q for _ in range(n)]
        start_col = [0] * n  # dummies: start 0, every column padding
        num_new = [0] * n
        for r, i in enumerate(row_map):
            if i < 0:
                continue
            toks = new_tokens[i]
            ids[r][q - len(toks) :] = toks
            start_col[r] = starts[i]
            num_new[r] = len(toks)
        # starts, new-token counts, arena rows: one host -> device copy, [n, 1] each
        start, k, write_rows = device_tensor(
            [start_col, num_new, arena_rows], torch.long, dev
        ).unsqueeze(2)
        i = torch.arange(q, dtype=torch.long, device=dev).unsqueeze(0) - (q - k)  # < 0: pad
        position_ids = start + i.clamp(min=0)  # [n, q]
        write_pos = torch.where(i >= 0, position_ids, -1)
        kv_len = max(1, max(s + t for s, t in zip(start_col, num_new, strict=True)))
        cache.plan(rows, write_rows, write_pos, kv_len)
        mask = attention.causal_mask(
            position_ids.unsqueeze(1), kv_len, model_dtype(model)
        )  # [n, 1, q, L]
        logits = self._call(model, cache, device_tensor(ids, torch.long, dev), position_ids, mask)
        if n != len(slots):
            live = [r for r, i in enumerate(row_map) if i >= 0]
            logits = logits.index_select(0, device_tensor(live, torch.long, dev))
        return logits

    def _forward_split(
        self,
        model: PreTrainedModel,
        cache: SlotKVCache,
        dec_slots: Sequence[int],
        dec_starts: Sequence[int],
        dec_tokens: Sequence[Sequence[int]],
        pre_slots: Sequence[int],
        pre_tokens: Sequence[Sequence[int]],
        order: Sequence[int] | None = None,
    ) -> Tensor:
        """One split-attention forward: decode rows, then every prefill token (each prefill
        sequence starts from an empty slot). Logits of the decode sequences then the prefill
        ones; with ``order``, row ``r`` is the logits of sequence ``order[r]`` of that list."""
        dtype, dev = model_dtype(model), self.device
        ids: list[int] = []
        positions: list[int] = []
        write_rows: list[int] = []
        keep: list[int] = []
        kv_len = 1
        # per decode bucket: the arena rows and columns it reads; its batch rows and columns
        arena_buckets: list[tuple[Tensor | slice, int]] = []
        dec_ranges: list[tuple[int, int, int]] = []
        # varlen: every token of the step, decode or prompt, is one row of ``varlen_decode``
        # reading its slot's columns 0 .. its position (a prompt's keys are written before
        # attention runs): no buckets, masks or per-prompt attention calls
        varlen = self._use_varlen(model)
        buckets = None
        if dec_slots and not varlen:
            buckets = self._decode_buckets([s + 1 for s in dec_starts])
        if varlen and dec_slots:  # rows in slot order, each reads its own length
            ids.extend(t[0] for t in dec_tokens)
            positions.extend(dec_starts)
            write_rows.extend(dec_slots)
            keep = list(range(len(dec_slots)))
            kv_len = max(dec_starts) + 1
        elif buckets is not None:
            # rows in bucket order; ``keep`` maps them back to the order of ``dec_slots``
            keep = [0] * len(dec_slots)
            for bucket in buckets:
                lo = len(ids)
                for i in bucket:
                    keep[i] = len(ids)
                    ids.append(dec_tokens[i][0])
                    positions.append(dec_starts[i])
                    write_rows.append(dec_slots[i])
                cols = max(dec_starts[i] for i in bucket) + 1
                dec_ranges.append((lo, len(ids), cols))
                arena_buckets.append((select_slots([dec_slots[i] for i in bucket], dev), cols))
                kv_len = max(kv_len, cols)
        elif dec_slots:
            rows, row_map, write_rows = self._choose_rows(dec_slots)
            for r, i in enumerate(row_map):
                if i < 0:
                    ids.append(self.pad_token_id)
                    positions.append(-1)
                else:
                    ids.append(dec_tokens[i][0])
                    positions.append(dec_starts[i])
                    keep.append(r)
            kv_len = max(dec_starts) + 1
            arena_buckets.append((rows, kv_len))  # one bucket: every row reads kv_len columns
            dec_ranges.append((0, len(ids), kv_len))
        n_decode = len(ids)
        # per batch row its prefill sequence (-1: a decode row); varlen rows need none
        segment = [] if varlen else [-1] * n_decode
        for k, (slot, toks) in enumerate(zip(pre_slots, pre_tokens, strict=True)):
            ids.extend(toks)
            positions.extend(range(len(toks)))
            write_rows.extend([slot] * len(toks))
            if not varlen:
                segment.extend([k] * len(toks))
            keep.append(len(ids) - 1)
        if order is not None:
            keep = [keep[j] for j in order]
        if varlen:  # the prompt tokens are varlen rows too
            n_decode = len(ids)
            kv_len = max([kv_len] + [len(t) for t in pre_tokens])
        # One host -> device copy of every index of the step, as rows of one [R, N] tensor:
        # ids, positions, arena rows, [output rows (padded)], [varlen lengths | prefill
        # segments].
        reorder = not (buckets is None and len(keep) == len(ids))
        host = [ids, positions, write_rows]
        if reorder:
            host.append(keep + [0] * (len(ids) - len(keep)))
        lens_row = len(host)
        if varlen:  # columns each row attends to: its position + 1
            host.append([p + 1 for p in positions])
        elif pre_slots:
            host.append(segment)
        packed = device_rows(host, dev)
        ids_t, position_ids, rows_t = packed[:3].unsqueeze(2)  # [N, 1] each
        pos = packed[1]
        dec_buckets = [  # (first row, end row, additive mask [rows, 1, 1, columns])
            (lo, hi, attention.causal_mask(pos[lo:hi].clamp(min=0).view(-1, 1, 1), cols, dtype))
            for lo, hi, cols in dec_ranges
        ]
        prefill_mask = None
        prefill_lengths = None
        if pre_slots and not varlen:
            cache.ensure_capacity(max(len(t) for t in pre_tokens))
            lengths = [len(t) for t in pre_tokens]
            if self._prompt_by_prompt(lengths):
                prefill_lengths = lengths
        if pre_slots and not varlen and prefill_lengths is None:
            seg, ppos = packed[-1, n_decode:], pos[n_decode:]
            allowed = (seg.unsqueeze(1) == seg.unsqueeze(0)) & (
                ppos.unsqueeze(0) <= ppos.unsqueeze(1)
            )
            prefill_mask = torch.zeros(1, 1, len(seg), len(seg), dtype=dtype, device=dev)
            prefill_mask.masked_fill_(~allowed, torch.finfo(dtype).min)
        cache.plan(
            slice(0, 0),  # reads are per bucket
            rows_t,
            position_ids,  # dummies have -1: trash column
            kv_len,
            buckets=arena_buckets,
            padded=not varlen,  # varlen rows are real tokens, none writes to the trash
        )
        # the batch rows whose logits are wanted, in the callers' order (None: every row):
        # the LM head runs on these alone, not on every prompt token of the step
        out_rows = packed[3, : len(keep)] if reorder else None
        if not varlen:
            position_ids = position_ids.clamp(min=0)
        direct = self._use_direct(model)  # (its first-use check runs split forwards itself)
        # direct varlen steps: keys written and attended on the arenas (``Rows.attend``),
        # no split state; other steps' attention reads ``state``
        step_rows = (
            varlen_decode.Rows(packed[2], packed[lens_row], kv_len) if direct and varlen else None
        )
        state, dummy_mask = None, None
        if step_rows is None:
            state = attention.SplitState(
                cache, n_decode, dec_buckets, prefill_mask, prefill_lengths
            )
            if varlen:
                state.decode_varlen = (packed[2, :n_decode], packed[lens_row, :n_decode], kv_len)
            dummy_mask = torch.zeros(1, 1, 1, 1, dtype=dtype, device=dev)  # real masks: `state`
        if direct:  # calls the split attention itself: only the state to set, no config swap
            attention.ACTIVE.state = state
            try:
                logits = direct_forward.direct_logits(
                    model,
                    ids_t,
                    position_ids,
                    cache,
                    attention.split_attention,
                    dummy_mask,
                    rows=out_rows,
                    varlen=step_rows,
                )
            finally:
                attention.ACTIVE.state = None
            self.num_forwards += 1
        else:
            assert state is not None and dummy_mask is not None
            with attention.split_attention_active(model, state):
                logits = self._call_rows(model, cache, ids_t, position_ids, dummy_mask, out_rows)
        return logits

    def _use_varlen(self, model: PreTrainedModel) -> bool:
        return (
            self.varlen_decode
            and attention.GROUPED_DECODE
            and self.device.type == "cpu"
            and model_dtype(model) == torch.float32
            and varlen_decode.available()
        )

    def _decode_buckets(self, lengths: Sequence[int]) -> list[list[int]] | None:
        """Decode rows grouped by cache length (indices into ``lengths``), or None for one group.

        Rows fall into power-of-two classes (``<= m``, ``<= 2m``, ... with ``m =
        bucket_min_len``); going up from the shortest, a class joins the next while the columns
        it would read in excess there (rows x (next class's longest - its own longest)) cost
        less than ``bucket_overhead``. Within a bucket rows keep their order (sorted slots stay
        sorted).
        """
        if self.bucket_overhead <= 0 or len(lengths) < 2:
            return None
        classes: dict[int, list[int]] = {}
        for i, n in enumerate(lengths):
            classes.setdefault((max(n, self.bucket_min_len) - 1).bit_length(), []).append(i)
        if len(classes) == 1:
            return None
        ordered = [classes[c] for c in sorted(classes)]
        buckets: list[list[int]] = []
        pending: list[int] = []
        for c, members in enumerate(ordered):
            pending = pending + members
            if c + 1 < len(ordered):
                longest = max(lengths[i] for i in pending)
                next_longest = max(lengths[i] for i in ordered[c + 1])
                if len(pending) * (next_longest - longest) < self.bucket_overhead:
                    continue
            buckets.append(sorted(pending))
            pending = []
        return buckets if len(buckets) > 1 else None

    def _prompt_by_prompt(self, lengths: Sequence[int]) -> bool:
        """Whether a step's prompts attend one call each rather than as one block-diagonal
        sequence. In query-key pairs: one call over all ``P = sum(lengths)`` tokens costs
        ``prefill_call_cost + P^2`` (most of the block-diagonal mask is masked-out pairs, and
        building the ``P x P`` mask is quadratic too), a call per prompt ``prefill_call_cost +
        p^2`` each. 32 prompts of 20 tokens at once (a wave of admissions: the start of an RL
        step): 2048 + 409600 against 32 x (2048 + 400); two of 20: 2048 + 1600 against 4896.
        One prompt is one call either way: it attends alone, with no mask built.
        """
        c = self.prefill_call_cost
        total = sum(lengths)
        return len(lengths) * c + sum(p * p for p in lengths) <= c + total * total

    def _use_direct(self, model: PreTrainedModel) -> bool:
        """Whether this split forward goes through ``direct_forward`` (see its docstring)."""
        if self._force_direct is not None:
            return self._force_direct
        if not self.direct:
            return False
        key = type(model)
        ok = self._direct_ok.get(key)
        if ok is None:
            ok = self._direct_ok[key] = direct_forward.supported(model) and self._check_direct(
                model
            )
        return ok and not model.training and not direct_forward.has_hooks(model)

    @torch.inference_mode()
    def _check_direct(self, model: PreTrainedModel) -> bool:
        """Two split steps (prefills, then decode rows of two length buckets next to a
        prefill) through ``direct_forward`` and through the model's modules: logits must be
        bitwise equal."""
        forwards = self.num_forwards
        saved = self.bucket_min_len, self.bucket_overhead
        try:
            vocab = cast(torch.nn.Embedding, model.get_input_embeddings()).num_embeddings
            g = torch.Generator().manual_seed(1)
            seqs = [
                torch.randint(0, vocab, (n,), generator=g, device=CPU).tolist() for n in (3, 40, 4)
            ]
            self.bucket_min_len, self.bucket_overhead = 2, 1  # force several decode buckets
            got = []
            for direct in (False, True):
                self._force_direct = direct
                cache = SlotKVCache(3, 64, device=self.device)
                first = self._forward_split(model, cache, [], [], [], [0, 1], seqs[:2])
                nxt = first.argmax(-1).tolist()
                second = self._forward_split(
                    model, cache, [0, 1], [3, 40], [[nxt[0]], [nxt[1]]], [2], seqs[2:]
                )
                got.append((first, second))
            (a1, a2), (b1, b2) = got
            return torch.equal(a1, b1) and torch.equal(a2, b2)
        except Exception:  # any incompatibility: the module path
            return False
        finally:
            self._force_direct = None
            self.bucket_min_len, self.bucket_overhead = saved
            self.num_forwards = forwards

    @torch.inference_mode()
    def _check_split(self, model: PreTrainedModel) -> bool:
        """Run two split steps on a scratch cache and compare with plain full forwards."""
        config = getattr(model, "config", None)
        if getattr(config, "_attn_implementation", None) not in ("sdpa", "eager"):
            return False
        forwards = self.num_forwards
        try:
            vocab = cast(torch.nn.Embedding, model.get_input_embeddings()).num_embeddings
            g = torch.Generator().manual_seed(0)
            seqs = [
                torch.randint(0, vocab, (n,), generator=g, device=CPU).tolist() for n in (5, 3, 4)
            ]
            cache = SlotKVCache(3, 16, device=self.device)
            first = self._forward_split(model, cache, [], [], [], [0, 1], seqs[:2])
            nxt = first.argmax(-1).tolist()
            second = self._forward_split(
                model, cache, [0, 1], [5, 3], [[nxt[0]], [nxt[1]]], [2], seqs[2:]
            )
            refs = [seqs[0], seqs[1], seqs[0] + [nxt[0]], seqs[1] + [nxt[1]], seqs[2]]
            got = [first[0], first[1], second[0], second[1], second[2]]
            for ids, logits in zip(refs, got, strict=True):
                ids_t = device_tensor([ids], torch.long, self.device)
                ref = model(input_ids=ids_t, use_cache=False).logits[0, -1].float()
                if not torch.allclose(logits, ref, atol=1e-4 * max(1.0, ref.abs().max().item())):
                    return False
            return True
        except Exception:  # any incompatibility: use the padded path
            return False
        finally:
            self.num_forwards = forwards
