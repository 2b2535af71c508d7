"""Experience: a padded token batch plus named per-sequence / per-token tensors.

This is what flows between roles in one iteration (veRL calls it DataProto). Per-token
tensors are [B, R] aligned with ``batch.response_ids``; per-sequence tensors are [B].
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from relayrl.model import TokenBatch, pack_batch
from relayrl.rollout.types import Sample


@dataclass
class Experience:
    batch: TokenBatch
    tensors: dict[str, Tensor] = field(default_factory=dict)
    samples: list[Sample] = field(default_factory=list)

    @classmethod
    def from_samples(cls, samples: Sequence[Sample], pad_id: int) -> Experience:
        """Pack finished samples; behaviour logprobs and token versions come along [B, R]."""
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
        exp = cls(batch, {"behaviour_logprobs": behav, "versions": versions}, list(samples))
        groups = [s.group_id if s.group_id is not None else i for i, s in enumerate(samples)]
        exp.tensors["group_index"] = torch.as_tensor(groups, dtype=torch.long)
        return exp

    def __len__(self) -> int:
        return len(self.batch)

    def __getitem__(self, key: str) -> Tensor:
        return self.tensors[key]

    def __setitem__(self, key: str, value: Tensor) -> None:
        if value.shape[0] != len(self):
            raise ValueError(f"tensor '{key}' has {value.shape[0]} rows, batch has {len(self)}")
        self.tensors[key] = value

    def __contains__(self, key: str) -> bool:
        return key in self.tensors

    @property
    def response_mask(self) -> Tensor:
        return self.batch.response_mask

    def select(self, index: Tensor | Sequence[int]) -> Experience:
        idx = torch.as_tensor(index, dtype=torch.long)
        samples = [self.samples[int(i)] for i in idx] if self.samples else []
        return Experience(
            self.batch.select(idx), {k: v[idx] for k, v in self.tensors.items()}, samples
        )

    def chunks(self, size: int) -> Iterator[Experience]:
        """Consecutive micro-batches of at most ``size`` sequences."""
        for start in range(0, len(self), size):
            yield self.select(range(start, min(start + size, len(self))))

    def shuffled_splits(self, n: int, generator: torch.Generator) -> list[Experience]:
        """A random permutation cut into ``n`` near-equal mini-batches."""
        perm = torch.randperm(len(self), generator=generator)
        return [self.select(part) for part in perm.tensor_split(n) if len(part) > 0]

    def meta(self) -> dict[str, Any]:
        lengths = self.response_mask.sum(-1)
        return {
            "response_length_mean": float(lengths.mean()),
            "response_length_max": float(lengths.max()),
        }
