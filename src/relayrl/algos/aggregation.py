"""Loss aggregation: from a per-token loss matrix [B, T] to the scalar that is backpropagated.

The normaliser (token or sequence count) is taken over the WHOLE optimizer step -- all
micro-batches and all data-parallel ranks -- and handed in as a :class:`LossNorm`. Then
``sum(aggregate_loss(mb) for mb in micro_batches)`` equals the loss of the whole batch, and
the gradient never depends on how the batch was split. Dividing each micro-batch by its own
count instead is the most frequent silent bug in RL post-training code.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

from relayrl.algos.masked import as_bool_mask, zero_masked

AGGREGATION_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
    "token-sum",
)


@dataclass(frozen=True)
class LossNorm:
    """Step-global normaliser for :func:`aggregate_loss`.

    ``global_tokens`` / ``global_seqs`` count unmasked tokens / sequences over the whole
    optimizer step (sum them over data-parallel ranks before building this).
    ``norm_constant`` is Dr.GRPO's constant (e.g. the max response length) used by
    ``seq-mean-token-sum-norm``.
    """

    mode: str
    global_tokens: float
    global_seqs: float
    norm_constant: float = 1.0

    def __post_init__(self) -> None:
        if self.mode not in AGGREGATION_MODES:
            raise ValueError(
                f"unknown loss aggregation mode {self.mode!r}; known: {list(AGGREGATION_MODES)}"
            )
        for name in ("global_tokens", "global_seqs"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"LossNorm.{name} must be a finite count >= 0, got {value!r}")
        if not (math.isfinite(self.norm_constant) and self.norm_constant > 0):
            raise ValueError(f"LossNorm.norm_constant must be > 0, got {self.norm_constant!r}")

    @staticmethod
    def for_batch(
        response_mask: Tensor | Sequence[Tensor],
        mode: str,
        norm_constant: float = 1.0,
        count_empty_rows: bool = True,
    ) -> LossNorm:
        """Counts from the mask of a full step (a [B, T] tensor, or the list of its
        micro-batch masks, which may differ in T): tokens = unmasked entries, seqs = rows
        (``count_empty_rows=False``: only rows with at least one token, as veRL counts)."""
        tokens, seqs = step_counts(response_mask, count_empty_rows)
        return LossNorm(mode, float(tokens), float(seqs), float(norm_constant))


def step_counts(
    response_mask: Tensor | Sequence[Tensor], count_empty_rows: bool = True
) -> tuple[int, int]:
    """(tokens, seqs) of :class:`LossNorm` for one process's part of a step: tokens =
    unmasked entries; seqs = rows, or with ``count_empty_rows=False`` only the rows with at
    least one token (veRL). The one place the convention is applied: the single-process
    actor and the data-parallel ranks (which sum these over ranks) both count with it."""
    masks = [response_mask] if isinstance(response_mask, Tensor) else list(response_mask)
    tokens = 0
    seqs = 0
    for mask in masks:
        if mask.dim() != 2:
            raise ValueError(f"response_mask must be [B, T], got shape {tuple(mask.shape)}")
        valid = as_bool_mask(mask)
        tokens += int(valid.sum().item())
        seqs += mask.shape[0] if count_empty_rows else int(valid.any(-1).sum().item())
    return tokens, seqs


def _safe_div(total: Tensor, denominator: float) -> Tensor:
    # A zero count only happens when every token is masked, and then the numerator is an
    # exact 0 too: return it (with its graph) rather than 0/0 = NaN.
    return total / (denominator if denominator != 0 else 1.0)


def aggregate_loss(loss_mat: Tensor, response_mask: Tensor, norm: LossNorm) -> Tensor:
    """Reduce a [B, T] per-token loss to a scalar with a step-global normaliser.

    l = loss_mat, m = mask, n_i = tokens of sequence i:
    - ``token-mean``:              sum(l*m) / global_tokens            (DAPO, Yu et al. 2025)
    - ``seq-mean-token-sum``:      sum_i sum_t(l*m) / global_seqs
    - ``seq-mean-token-mean``:     sum_i (sum_t(l*m) / n_i) / global_seqs
      (GRPO as in DeepSeekMath, Shao et al. 2024; a sequence with n_i = 0 contributes 0)
    - ``seq-mean-token-sum-norm``: sum(l*m) / (global_seqs * norm_constant)
      (Dr.GRPO, Liu et al. 2025)
    - ``token-sum``:               sum(l*m)                            (no normaliser)

    ``token-sum`` is the plain sum over the step's tokens (the "sum" reduction of e.g. Tinker's
    and ScaleRL's losses): the gradient then grows with the number of tokens in a step, so
    the learning rate absorbs the batch size. veRL has no such mode.

    Empty rows: relayrl's ``global_seqs`` counts every row of the step, empty ones included
    (an empty row adds 0 to the numerator); veRL's ``seq-mean-*`` modes divide by the rows
    with at least one token. ``algo.seq_mean_empty_rows: skip`` (``LossNorm.for_batch(...,
    count_empty_rows=False)``) gives veRL's denominator.
    """
    if loss_mat.shape != response_mask.shape or loss_mat.dim() != 2:
        raise ValueError(
            f"loss_mat {tuple(loss_mat.shape)} and response_mask {tuple(response_mask.shape)} "
            "must both be [B, T]"
        )
    mask = as_bool_mask(response_mask)
    per_token = zero_masked(loss_mat, mask)
    if norm.mode == "seq-mean-token-mean":
        n_i = mask.sum(-1).clamp(min=1).to(loss_mat.dtype)
        return _safe_div((per_token.sum(-1) / n_i).sum(), norm.global_seqs)
    total = per_token.sum()
    if norm.mode == "token-mean":
        return _safe_div(total, norm.global_tokens)
    if norm.mode == "seq-mean-token-sum":
        return _safe_div(total, norm.global_seqs)
    if norm.mode == "seq-mean-token-sum-norm":
        return _safe_div(total, norm.global_seqs * norm.norm_constant)
    if norm.mode == "token-sum":
        return total
    raise AssertionError(f"unhandled mode {norm.mode!r}")  # LossNorm validated it
