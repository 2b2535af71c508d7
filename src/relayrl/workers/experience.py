"""Experience: one step's batch, a padded token batch plus named, typed per-row fields.

This is what flows between roles in one iteration (veRL calls it DataProto). Every field is
named and optional (None until a phase of the step fills it; ``controller.algorithms`` says
which phase fills which). Per-token fields are [B, R] aligned with ``batch.response_ids``;
per-sequence fields are [B]:

=====================  ======  ==============================================================
field                  shape   meaning (units)
=====================  ======  ==============================================================
``behaviour_logprobs`` [B, R]  log pi_behav(y_t): the engine's, at sampling time (nats)
``versions``           [B, R]  policy version that generated each token (int)
``group_index``        [B]     the prompt group of each row (int; its own row without one)
``scores``             [B]     the reward of each sequence (after mixing)
``outcomes``           [B]     the raw verifiable outcome (1.0 = solved)
``old_logprobs``       [B, R]  log pi_old / pi_prox, the trainer's before the update (nats)
``ref_logprobs``       [B, R]  log pi_ref of the frozen reference (nats)
``teacher_logprobs``   [B, R]  log pi_teacher (on-policy distillation; nats)
``values``             [B, R]  V(s_t) of the critic before the update
``returns``            [B, R]  the critic's targets R_t
``advantages``         [B, R]  A_t
``kl``                 [B, R]  per-token KL(pi_old || pi_ref) in the reward (nats)
``kl_coefs``           [B]     an adaptive beta of the KL loss term, one value repeated per row
``rollout_weights``    [B, R]  constant per-token weights of the policy loss (off-policy)
=====================  ======  ==============================================================

Multi-turn samples (``Sample.loss_mask``, ``relayrl.env``) hold observation tokens inside a
row: ``batch.attention_mask`` keeps every real token (the model attends to all of them), while
``response_mask`` -- the mask of every loss, advantage, KL, staleness and mismatch statistic --
is ``real_token_mask * loss_mask``, so observation tokens are never trained or counted. Lengths
(trimming, token-budget micro-batching, length stats) are real token counts
(``response_lengths``), not mask sums.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
from torch import Tensor

from relayrl.model import TokenBatch, pack_batch
from relayrl.rollout.types import Sample

_NOT_TENSORS = frozenset({"batch", "samples"})


def _upload(t: Tensor, device: torch.device) -> Tensor:
    """``t`` on ``device``. Host -> CUDA goes through pinned memory, asynchronously: a copy
    from pageable memory waits for the device (a host sync per tensor); the pinned staging
    buffer is held by torch's caching host allocator until its copy is done."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@dataclass
class Experience:
    batch: TokenBatch
    samples: list[Sample] = field(default_factory=list)
    behaviour_logprobs: Tensor | None = None
    versions: Tensor | None = None
    group_index: Tensor | None = None
    scores: Tensor | None = None
    outcomes: Tensor | None = None
    old_logprobs: Tensor | None = None
    ref_logprobs: Tensor | None = None
    teacher_logprobs: Tensor | None = None
    values: Tensor | None = None
    returns: Tensor | None = None
    advantages: Tensor | None = None
    kl: Tensor | None = None
    kl_coefs: Tensor | None = None
    rollout_weights: Tensor | None = None

    def __setattr__(self, name: str, value: Any) -> None:
        """A tensor field must have one row per sequence (ValueError otherwise)."""
        if isinstance(value, Tensor) and name not in _NOT_TENSORS and "batch" in self.__dict__:
            if value.dim() == 0 or value.shape[0] != len(self):
                rows = value.shape[0] if value.dim() else 0
                raise ValueError(f"tensor '{name}' has {rows} rows, batch has {len(self)}")
        object.__setattr__(self, name, value)

    @classmethod
    def from_samples(cls, samples: Sequence[Sample], pad_id: int) -> Experience:
        """Pack finished samples; behaviour logprobs and token versions come along [B, R],
        the group of each row [B].

        A sample's ``loss_mask`` (None = all ones) zeroes its observation tokens in
        ``response_mask``; a loss mask whose length is not the response's is a ValueError."""
        batch = pack_batch(
            [s.prompt_ids for s in samples], [s.response_ids for s in samples], pad_id
        )
        r = batch.response_ids.shape[1]
        behav = torch.zeros((len(samples), r), dtype=torch.float32)
        versions = torch.zeros((len(samples), r), dtype=torch.long)
        for i, s in enumerate(samples):
            n = len(s.response_ids)
            behav[i, :n] = torch.as_tensor(s.behaviour_logprobs, dtype=torch.float32)
            versions[i, :n] = torch.as_tensor(s.versions, dtype=torch.long)
            if s.loss_mask is not None:
                if len(s.loss_mask) != n:
                    raise ValueError(
                        f"sample {s.request_id}: loss_mask has {len(s.loss_mask)} entries for "
                        f"{n} response tokens"
                    )
                batch.response_mask[i, :n] *= torch.as_tensor(s.loss_mask, dtype=torch.float32)
        groups = [s.group_id if s.group_id is not None else i for i, s in enumerate(samples)]
        return cls(
            batch,
            list(samples),
            behaviour_logprobs=behav,
            versions=versions,
            group_index=torch.as_tensor(groups, dtype=torch.long),
        )

    def __len__(self) -> int:
        return len(self.batch)

    def tensors(self) -> dict[str, Tensor]:
        """The fields that are set, by name (the batch and the samples apart)."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name not in _NOT_TENSORS and value is not None:
                out[f.name] = value
        return out

    @property
    def response_mask(self) -> Tensor:
        """[B, R] 1.0 on trained response tokens (real and, multi-turn, loss mask 1)."""
        return self.batch.response_mask

    @property
    def response_lengths(self) -> Tensor:
        """[B] real response token count of each row (observation tokens included)."""
        return self.batch.attention_mask[:, self.batch.prompt_width :].sum(-1)

    def select(self, index: Tensor | Sequence[int]) -> Experience:
        idx = torch.as_tensor(index, dtype=torch.long)
        samples = [self.samples[int(i)] for i in idx] if self.samples else []
        # Any: mypy checks ``**`` of a dict[str, Tensor] against every field, samples included
        tensors: dict[str, Any] = {k: v[idx] for k, v in self.tensors().items()}
        return replace(self, batch=self.batch.select(idx), samples=samples, **tensors)

    def to(self, device: torch.device) -> Experience:
        """The batch and every tensor on ``device`` (itself when already there)."""
        if self.batch.input_ids.device == device:
            return self
        b = self.batch
        batch = TokenBatch(
            _upload(b.input_ids, device),
            _upload(b.attention_mask, device),
            _upload(b.position_ids, device),
            b.prompt_width,
            _upload(b.response_ids, device),
            _upload(b.response_mask, device),
            b.has_padding(),  # known here on the host, so the forward need not read the device
        )
        tensors: dict[str, Any] = {k: _upload(v, device) for k, v in self.tensors().items()}
        return replace(self, batch=batch, **tensors)

    def micro_batches(
        self, max_seqs: int, max_tokens: int | None = None
    ) -> Iterator[tuple[Tensor, Experience]]:
        """Micro-batches as ``(row index, trimmed sub-batch)``.

        Each sub-batch keeps only the response columns up to its own longest response, so a
        long answer elsewhere in the batch costs no padding here; per-token tensors are trimmed
        with it. Without ``max_tokens``: consecutive chunks of ``max_seqs`` rows. With it
        (veRL's dynamic batch size): rows sorted by length and packed greedily so that
        rows x padded length (prompt width P + longest response) <= max_tokens, at most
        ``max_seqs`` rows; a row longer than the budget gets a micro-batch of its own.
        With a step-global ``LossNorm`` the summed gradient does not depend on the split.
        """
        n = len(self)
        groups: list[Tensor]
        if max_tokens is None:
            order = torch.arange(n)
            groups = [order[s : s + max_seqs] for s in range(0, n, max_seqs)]
        else:
            lengths = self.response_lengths.long()
            order = torch.argsort(lengths, descending=True, stable=True)
            p = self.batch.prompt_width
            groups, width = [], 0
            current: list[int] = []
            for i in order.tolist():
                w = max(width, p + int(lengths[i]))
                if current and (len(current) >= max_seqs or (len(current) + 1) * w > max_tokens):
                    groups.append(torch.as_tensor(current))
                    current, w = [], p + int(lengths[i])
                current.append(i)
                width = w
            if current:
                groups.append(torch.as_tensor(current))
        for idx in groups:
            yield idx, self.select(idx).trimmed()

    def trimmed(self) -> Experience:
        """Drop response columns past the longest response (per-token tensors too)."""
        r = self.batch.response_ids.shape[1]
        keep = max(1, int(self.response_lengths.max())) if len(self) else r
        if keep >= r:
            return self
        b = self.batch
        p = b.prompt_width
        batch = TokenBatch(
            b.input_ids[:, : p + keep],
            b.attention_mask[:, : p + keep],
            b.position_ids[:, : p + keep],
            p,
            b.response_ids[:, :keep],
            b.response_mask[:, :keep],
        )
        tensors: dict[str, Any] = {
            k: v[:, :keep] if v.dim() >= 2 and v.shape[1] == r else v
            for k, v in self.tensors().items()
        }
        return replace(self, batch=batch, **tensors)

    def scatter_tokens(
        self, parts: Sequence[tuple[Tensor, Tensor]], dtype: torch.dtype = torch.float32
    ) -> Tensor:
        """Reassemble per-token outputs of ``micro_batches`` into one [B, R] tensor (zeros past
        each part's width) on the parts' device, in their dtype. No parts (a data-parallel
        rank whose shard has no rows): a [0, R] tensor of ``dtype`` on this batch's device."""
        if not parts:
            if len(self):
                raise ValueError(f"no micro-batch outputs for a batch of {len(self)} rows")
            return torch.zeros(
                self.response_mask.shape, dtype=dtype, device=self.response_mask.device
            )
        # on the parts' device (the model's): one transfer for the whole batch, not one per part
        first = parts[0][1]
        out = torch.zeros(self.response_mask.shape, dtype=first.dtype, device=first.device)
        for idx, values in parts:
            out[idx, : values.shape[1]] = values
        return out

    def shuffled_splits(
        self, n: int, generator: torch.Generator, offset: int = 0, total: int | None = None
    ) -> list[Experience]:
        """A random permutation of the global batch cut into ``n`` near-equal mini-batches,
        each restricted to this part of it.

        One process: ``self`` is the global batch (``offset`` 0, ``total`` its length). A
        data-parallel rank: ``self`` is rows ``offset .. offset + len(self)`` of a global
        batch of ``total`` rows; every rank draws the same permutation (same generator
        state), so the union over ranks of their i-th parts is exactly the i-th mini-batch
        of one process (world-size invariance for every ``n``). A rank's part may be empty;
        it still takes the step (its gradient is zero, the collectives are joined).
        """
        total = len(self) if total is None else total
        perm = torch.randperm(total, generator=generator)
        out = []
        for part in perm.tensor_split(n):
            if len(part) == 0:
                continue
            mine = part[(part >= offset) & (part < offset + len(self))] - offset
            out.append(self.select(mine))
        return out

    def meta(self) -> dict[str, Any]:
        """Length stats in real tokens; with observation tokens in the batch also the trained
        (model) tokens per row, ``trained_length_mean``."""
        lengths = self.response_lengths.float()
        out = {
            "response_length_mean": float(lengths.mean()),
            "response_length_max": float(lengths.max()),
        }
        trained = self.response_mask.sum(-1)
        if bool((trained != lengths).any()):
            out["trained_length_mean"] = float(trained.mean())
        return out
