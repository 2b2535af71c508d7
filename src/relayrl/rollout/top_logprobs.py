"""Per-request top-k logprobs (off by default): the built-in engine's capture, and the format
every backend (the engine, its worker process, vLLM) serves.

A request with ``SamplingParams.top_logprobs = k > 0`` gets, for every response token, the
``k`` most likely tokens of the distribution that token was drawn from, with their logprobs,
most likely first: the sampler's distribution (:mod:`relayrl.rollout.sampler`),

    log_softmax(top_p_filter(top_k_filter(logits / temperature)))

and, for a greedy request, ``log_softmax(logits)`` (temperature 1, unfiltered), so the
sampled token's own entry, when it is among the ``k``, is its behaviour logprob (the same
operations on the same fp32 row). Tokens the filters removed (probability 0) are left out:
a row keeps fewer than ``k`` entries when fewer survive. Ties keep ``torch.topk``'s order.

The capture runs after the step's draw, on the step's logits, for the rows that asked only:
it never changes the sampled tokens or their logprobs. While no live request asks for them
(the scheduler counts those that do: ``Scheduler.with_top``) a step tests one integer and does
nothing else. Alternatives are kept per sequence
(``Sequence.top``) and survive an interrupt (a re-prefill resamples nothing already sampled);
they come out as ``Sample.top_logprobs`` and, to a streaming reader, as a fourth element of
``RolloutEngine.progress``.

The other backends serve the same format: the engine worker process runs this engine and sends
the alternatives with the sample and its streamed progress
(:mod:`relayrl.cluster.live_requests`); vLLM, run with ``logprobs_mode="processed_logprobs"``
(logprobs after temperature, top-k and top-p, the same distribution), asked for
``SamplingParams(logprobs=k)``, reports its top ``k`` plus the sampled token per position,
turned into this format by :func:`from_ranked`.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as Seq
from typing import Any

import torch
from torch import Tensor

from relayrl.rollout.sampler import _filter_top_k_top_p

MAX_TOP_LOGPROBS = 20
"""Most alternatives one request may ask for per token (OpenAI's limit too)."""

TopLogprobs = list[tuple[int, float]]
"""One token's alternatives: ``(token id, logprob)``, most likely first."""

SERVER_FLOOR = -9999.0
"""vLLM's server writes a logprob of ``-inf`` (a token the filters removed) as this."""


def check(k: int) -> str | None:
    """Why ``top_logprobs = k`` cannot be served (None: it can)."""
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_TOP_LOGPROBS:
        return f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {k!r}"
    return None


def capture(logits: Tensor, seqs: Seq[Any]) -> None:
    """Append each asking sequence's alternatives of this step's token (see module);
    ``logits`` fp32 ``[len(seqs), vocab]``, row ``i`` sequence ``i``'s, after the draw."""
    rows = [i for i, s in enumerate(seqs) if s.top is not None]
    if not rows:  # others elsewhere keep alternatives, none in this forward
        return
    settings = [seqs[i].settings for i in rows]
    x = logits[rows]
    temps = [s.temperature for s in settings]
    if any(t != 1.0 for t in temps):
        x = x / torch.tensor(temps, dtype=x.dtype, device=x.device).unsqueeze(1)
    if any(s.filters for s in settings):
        x = _filter_top_k_top_p(x, [s.top_k for s in settings], [s.top_p for s in settings])
    logp = torch.log_softmax(x, dim=-1)
    ks = [seqs[i].request.params.top_logprobs for i in rows]
    best = logp.topk(min(max(ks), logp.shape[-1]), dim=-1)
    values, ids = best.values.cpu().tolist(), best.indices.cpu().tolist()
    for j, i in enumerate(rows):
        pairs = zip(ids[j][: ks[j]], values[j][: ks[j]], strict=True)
        seqs[i].top.append([(t, v) for t, v in pairs if v != float("-inf")])


def from_ranked(
    entries: Iterable[tuple[int, float, int | None]],
    sampled: int,
    k: int,
    removed: float = float("-inf"),
) -> TopLogprobs:
    """One token's alternatives from vLLM's logprobs of its position: ``entries`` as
    ``(token id, logprob, rank)`` (rank 1 = most likely), holding the top ``k`` (ranks 1 to
    ``k``) and the sampled token ``sampled`` (rank: 1 + the number of tokens more likely).

    Kept: the entries of rank 1 to ``k``, by rank. The sampled token's entry is one of them
    when it is in the top ``k``; outside it, its rank is ``<= k`` only under a tie with the
    ``k``-th, and it is then the one entry too many: dropped (the top ``k`` are ``torch.topk``'s,
    as here). Entries with a logprob ``<= removed`` (filtered out: ``-inf``; over the
    server's JSON ``SERVER_FLOOR``) are left out, as :func:`capture` leaves them out."""
    kept = [(r, t, v) for t, v, r in entries if r is not None and 1 <= r <= k]
    if len(kept) > k:
        kept = [e for e in kept if e[1] != sampled]
    kept.sort(key=lambda e: e[0])
    return [(t, v) for _, t, v in kept if v > removed]
