"""Top-k logprobs of Tinker sample requests: ``topk_prompt_logprobs`` and
``topk_sample_logprobs`` (``SampleResponse.topk_prompt_logprobs``,
``SampledSequence.topk_logprobs``).

Prompt rows (``topk_prompt_logprobs = k``): row ``i >= 1`` holds the ``k`` most likely tokens
of the model's next-token distribution after ``prompt[:i]``, with their logprobs

    log_softmax(logits[i - 1])        (fp32, temperature 1, no top-k / top-p filter)

under the sampler's weights: the distribution the prompt logprobs (``include_prompt_logprobs``,
``compute_logprobs``) are taken from, so ``prompt[i]``'s prompt logprob equals its entry in row
``i`` when it is among the ``k``. The request's temperature and filters do not apply (prompt
tokens were not drawn from them). Row 0 (no context) is None, and with
``prompt_logprobs_last_n = n`` so is every row before ``len(prompt) - n``, as for the prompt
logprobs. Both come from one forward of the prompt.

Sampled rows (``topk_sample_logprobs = k``): the engine's alternatives of each sampled token
(``SamplingParams.top_logprobs``, :mod:`relayrl.rollout.top_logprobs`, what the OpenAI
endpoint serves): the distribution the token was drawn from (temperature, ``top_k``, ``top_p``
applied; greedy: temperature 1), so the sampled token's entry equals its logprob in
``SampledSequence.logprobs``; tokens a filter removed are left out (a row may hold fewer than
``k``).

Order: descending logprob; equal logprobs by ascending token id. For prompt rows this also
decides which tokens of a tie across the ``k``-th place are kept; sampled rows reorder the
``k`` the engine kept (at a tie across the ``k``-th place the engine keeps ``torch.topk``'s).

``k``: 0 (off) to :data:`MAX_TOPK`; larger, negative or not an integer is a 400. A ``k``
above the vocabulary size gives rows of the whole vocabulary (the SDK's "up to k").

Wire: a ``TopkLogprobs`` message, dense ``length x k`` row-major int32 ids and float32
logprobs, empty cells ``(0, -99999.0)``; the SDK reads a row whose first cell is empty as None
and drops a row's trailing empty cells.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from relayrl.rollout.top_logprobs import MAX_TOP_LOGPROBS

MAX_TOPK = MAX_TOP_LOGPROBS
"""Most tokens per position one request may ask for (the engine's top_logprobs limit, 20)."""

EMPTY_LOGPROB = -99999.0
"""The SDK's filler for an empty cell (``tinker.types.topk_logprobs.MASK_LOGPROB``)."""

TopRow = list[tuple[int, float]]
"""One position's ``(token id, logprob)``, most likely first."""


def check_k(name: str, value: Any) -> str | None:
    """Why ``name = value`` cannot be served (None: it can)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOPK:
        return f"{name} must be an integer in [0, {MAX_TOPK}], got {value!r}"
    return None


def top_rows(logp: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """(values, ids), each ``[N, min(k, V)]``: every row's ``k`` largest entries of ``logp``
    ``[N, V]``, by descending value, equal values by ascending index (also across the
    ``k``-th place: ``torch.topk`` alone picks among tied tokens in no promised order)."""
    k = min(k, logp.shape[-1])
    values, ids = logp.topk(k, dim=-1)
    # a row with more than k entries >= its k-th value has a tie across the cut: its stable
    # full sort (equal values keep ascending index) decides which are kept
    over = ((logp >= values[:, -1:]).sum(-1) > k).nonzero()[:, 0]
    if len(over):
        sv, si = logp[over].sort(dim=-1, descending=True, stable=True)
        values[over], ids[over] = sv[:, :k], si[:, :k]
    ids, perm = ids.sort(dim=-1)
    values = values.gather(-1, perm)
    values, perm = values.sort(dim=-1, descending=True, stable=True)
    return values, ids.gather(-1, perm)


def prompt_scores(
    model: torch.nn.Module, prompt: list[int], k: int = 0, last_n: int | None = None
) -> tuple[list[float | None], list[TopRow | None] | None]:
    """The prompt's logprobs ``log p(prompt[i] | prompt[:i])`` (None for i = 0) and, for
    ``k > 0``, its top-k rows (see module; None without ``k``), from one fp32 forward;
    ``last_n``: entries before ``len(prompt) - last_n`` are None in both."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0].float()
        logp = torch.log_softmax(logits[:-1], dim=-1)
        picked = logp.gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0]
        plp: list[float | None] = [None, *picked.tolist()]
        cut = 1 if last_n is None else len(prompt) - last_n
        rows: list[TopRow | None] | None = None
        if k > 0:  # rows cut.. score positions cut..: logp's rows cut - 1..
            values, ids = top_rows(logp[cut - 1 :], k)
            rows = [None] * cut
            rows += [
                list(zip(i, v, strict=True))
                for i, v in zip(ids.tolist(), values.tolist(), strict=True)
            ]
    return [None if i < cut else v for i, v in enumerate(plp)], rows


def ordered(row: TopRow) -> TopRow:
    """A sampled token's alternatives by descending logprob, then ascending token id."""
    return sorted(row, key=lambda e: (-e[1], e[0]))


def dense(rows: list[TopRow | None], k: int) -> tuple[np.ndarray, np.ndarray]:
    """``(ids int32, logprobs float32)``, each ``[len(rows), k]``, empty cells
    ``(0, EMPTY_LOGPROB)`` (a None row: all empty)."""
    ids = np.zeros((len(rows), k), dtype=np.int32)
    lps = np.full((len(rows), k), EMPTY_LOGPROB, dtype=np.float32)
    for r, row in enumerate(rows):
        for c, (t, v) in enumerate((row or [])[:k]):
            ids[r, c], lps[r, c] = t, v
    return ids, lps
