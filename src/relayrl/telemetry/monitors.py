"""Run monitors for reward hacking and collapse, computed on every step's samples.

- KL to the reference per sequence (Monte-Carlo, samples y ~ pi):
  KL(pi || pi_ref) ~= mean_i sum_t (log pi(y_it) - log pi_ref(y_it))   (k1, summed over tokens)
- Diversity: distinct-n = |unique n-grams| / |n-grams| over the batch's completions, words
  split on whitespace (Li et al. 2016), and the number / fraction of distinct completions.
- Proxy vs gold, when the run has a gold scorer (``monitor.gold_fn``): batch means of both,
  their Pearson correlation, the pairwise agreement (fraction of pairs with different gold
  scores that the proxy orders the same way), and the standardised divergence since the
  first monitored step
      D_t = (P_t - P_0) / sd(P_0) - (G_t - G_0) / sd(G_0)
  with P, G the batch means of proxy and gold and sd(.) the first batch's standard deviation:
  D_t grows when the proxy climbs faster than the gold score (reward hacking).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "GoldScore",
    "RunMonitor",
    "distinct_n",
    "distinct_responses",
    "pairwise_agreement",
    "pearson",
    "sequence_kl",
]

GoldScore = Callable[[str, str, dict], dict[str, float]]
"""``(prompt, completion, sample) -> {"score": ..., other components}``."""


def distinct_n(texts: Sequence[str], n: int) -> float:
    """|unique word n-grams| / |word n-grams| over all ``texts`` (0.0 when there are none)."""
    grams: list[tuple[str, ...]] = []
    for t in texts:
        words = t.split()
        grams.extend(tuple(words[i : i + n]) for i in range(len(words) - n + 1))
    return len(set(grams)) / len(grams) if grams else 0.0


def distinct_responses(texts: Sequence[str]) -> int:
    """The number of different completions (after stripping surrounding whitespace)."""
    return len({t.strip() for t in texts})


def sequence_kl(logprobs: Tensor, ref_logprobs: Tensor, response_mask: Tensor) -> Tensor:
    """Per-sequence k1 estimate sum_t m_t (log pi - log pi_ref) [B]; its mean over samples of
    pi is an unbiased estimate of KL(pi || pi_ref) between sequence distributions."""
    return ((logprobs - ref_logprobs) * response_mask).sum(-1)


def pearson(x: Sequence[float], y: Sequence[float]) -> float:
    """Pearson correlation; NaN when either side is constant or there are < 2 points."""
    if len(x) < 2:
        return float("nan")
    xt = torch.as_tensor(list(x), dtype=torch.float64)
    yt = torch.as_tensor(list(y), dtype=torch.float64)
    xc, yc = xt - xt.mean(), yt - yt.mean()
    den = float(xc.norm() * yc.norm())
    return float((xc * yc).sum()) / den if den > 0 else float("nan")


def pairwise_agreement(proxy: Sequence[float], gold: Sequence[float]) -> float:
    """Fraction of pairs (i, j) with gold_i != gold_j that the proxy orders the same way
    (proxy ties count 1/2); NaN when all gold scores are equal."""
    p = torch.as_tensor(list(proxy), dtype=torch.float64)
    g = torch.as_tensor(list(gold), dtype=torch.float64)
    dg = torch.sign(g[:, None] - g[None, :])
    dp = torch.sign(p[:, None] - p[None, :])
    valid = dg != 0
    if not bool(valid.any()):
        return float("nan")
    agree = (dp == dg).double() + 0.5 * (dp == 0).double()
    return float(agree[valid].mean())


class RunMonitor:
    """Per-step monitor metrics (``monitor/*``) from an ``Experience``.

    Args:
        tokenizer: decodes the completions.
        gold_score: the gold scorer ``fn(prompt, completion, sample) -> dict[str, float]``
            with a ``"score"`` key (``monitor.gold_fn`` through ``relayrl.reward.score``; the
            controller builds it, so this layer imports no reward code), or None.
    """

    def __init__(self, tokenizer: Any, gold_score: GoldScore | None = None):
        self.tokenizer = tokenizer
        self.gold_score = gold_score
        self._baseline: tuple[float, float, float, float] | None = None

    def texts(self, exp: Any) -> tuple[list[str], list[str], list[dict]]:
        fields = [dict(s.metadata) for s in exp.samples]
        prompts = [str(f.get("prompt", "")) for f in fields]
        completions = [
            self.tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in exp.samples
        ]
        return prompts, completions, fields

    @torch.no_grad()
    def __call__(self, exp: Any) -> dict[str, float]:
        out: dict[str, float] = {}
        if not exp.samples:
            return out
        prompts, completions, fields = self.texts(exp)
        out["monitor/distinct_1"] = distinct_n(completions, 1)
        out["monitor/distinct_2"] = distinct_n(completions, 2)
        n_distinct = distinct_responses(completions)
        out["monitor/distinct_responses"] = float(n_distinct)
        out["monitor/distinct_frac"] = n_distinct / len(completions)
        if exp.ref_logprobs is not None:
            logp = exp.old_logprobs if exp.old_logprobs is not None else exp.behaviour_logprobs
            out["monitor/kl_seq"] = float(
                sequence_kl(logp, exp.ref_logprobs, exp.response_mask).mean()
            )
        if self.gold_score is not None and exp.scores is not None:
            out.update(self._proxy_vs_gold(exp.scores.tolist(), prompts, completions, fields))
        return out

    def _proxy_vs_gold(
        self, proxy: list[float], prompts: list[str], completions: list[str], fields: list[dict]
    ) -> dict[str, float]:
        gold_score = self.gold_score
        assert gold_score is not None  # the caller checks
        triples = zip(prompts, completions, fields, strict=True)
        comps = [gold_score(p, c, f) for p, c, f in triples]
        gold = [c["score"] for c in comps]
        out: dict[str, float] = {}
        for key in comps[0]:
            name = "gold" if key == "score" else f"gold_{key}"
            out[f"monitor/{name}"] = math.fsum(c.get(key, 0.0) for c in comps) / len(comps)
        p_mean = math.fsum(proxy) / len(proxy)
        g_mean = out["monitor/gold"]
        out["monitor/proxy"] = p_mean
        out["monitor/proxy_gold_corr"] = pearson(proxy, gold)
        out["monitor/proxy_gold_agreement"] = pairwise_agreement(proxy, gold)
        if self._baseline is None:
            p_sd = float(torch.tensor(proxy, dtype=torch.float64).std()) if len(proxy) > 1 else 1
            g_sd = float(torch.tensor(gold, dtype=torch.float64).std()) if len(gold) > 1 else 1
            self._baseline = (p_mean, g_mean, p_sd or 1.0, g_sd or 1.0)
        p0, g0, psd, gsd = self._baseline
        out["monitor/proxy_gain"] = p_mean - p0
        out["monitor/gold_gain"] = g_mean - g0
        out["monitor/divergence"] = (p_mean - p0) / psd - (g_mean - g0) / gsd
        return out
