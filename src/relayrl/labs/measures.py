"""The lab's measurements: samples from a policy, labelled pairs, how well the reward model
agrees with the labels and the truth, its blind spot, and a policy's proxy vs true score.

- ``label_pairs``: of two completions per prompt the first is chosen with probability
  sigmoid((s_1 - s_2) / T) on the true scores (1/2 on ties); identical pairs are dropped.
- ``rm_agreement``: fraction of held-out pairs the RM orders like the labels, against the
  noise ceiling E[max(p, 1 - p)], and like the truth where the true scores differ.
- ``probe_blind_spot``: the words of grammatical sentences shuffled (true score -3); how often
  the RM scores the shuffle at least as high as the original.
- ``evaluate_policy``: fresh samples scored by the RM (proxy) and the true score, grammatical
  fraction, KL(pi || pi_ref) per sequence (k1 summed over tokens), distinct responses.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from relayrl.data import city_lang as cl
from relayrl.data.preferences import PreferencePair
from relayrl.model import forward_logprobs, load_causal_lm, load_tokenizer, pack_batch
from relayrl.reward.service.rm_scorer import RewardModelScorer
from relayrl.rollout import GenerationRequest, RolloutEngine, SamplingParams
from relayrl.telemetry.monitors import distinct_n, distinct_responses

__all__ = [
    "evaluate_policy",
    "lab_prompts",
    "label_pairs",
    "probe_blind_spot",
    "rm_agreement",
    "sample_completions",
]


# ------------------------------------------------------------------------------- sampling


def sample_completions(
    model: torch.nn.Module,
    tokenizer: Any,
    prompts: Sequence[str],
    max_tokens: int,
    seed: int,
    temperature: float = 1.0,
) -> tuple[list[str], list[list[int]], list[list[int]], list[list[float]]]:
    """One sampled completion per prompt with the rollout engine (seeded per request).

    Returns texts, prompt ids, response ids (EOS included when emitted) and behaviour logprobs.
    """
    engine = RolloutEngine(
        model,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        max_slots=max(1, min(256, len(prompts))),
    )
    reqs = [
        GenerationRequest(
            list(tokenizer(p).input_ids),
            SamplingParams(
                temperature=temperature,
                max_tokens=max_tokens,
                stop_token_ids=[tokenizer.eos_token_id],
                seed=(seed * 1_000_003 + i) & 0x7FFFFFFF,
            ),
        )
        for i, p in enumerate(prompts)
    ]
    samples = engine.generate(reqs)
    texts = [tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in samples]
    return (
        texts,
        [s.prompt_ids for s in samples],
        [s.response_ids for s in samples],
        [s.behaviour_logprobs for s in samples],
    )


def lab_prompts(n: int, seed: int) -> list[str]:
    """``n`` prompts ``"<city> is"``, cities cycled in a seeded order (balanced)."""
    rng = random.Random(seed)
    out: list[str] = []
    while len(out) < n:
        cities = list(cl.CITIES)
        rng.shuffle(cities)
        out.extend(cl.CityLanguage.prompt(c) for c in cities)
    return out[:n]


def label_pairs(
    prompts: Sequence[str],
    first: Sequence[str],
    second: Sequence[str],
    seed: int,
    temperature: float = 1.0,
) -> tuple[list[PreferencePair], int]:
    """Bradley-Terry labels on the true score: the first completion is chosen with
    probability sigmoid((s_1 - s_2) / T) (1/2 on ties). Pairs of identical completions are
    dropped (counted): they carry no preference. Extra fields keep the true scores."""
    rng = random.Random(seed)
    pairs: list[PreferencePair] = []
    dropped = 0
    for prompt, a, b in zip(prompts, first, second, strict=True):
        if a.strip() == b.strip() or not a.strip() or not b.strip():
            dropped += 1
            continue
        sa, sb = cl.true_score(prompt, a), cl.true_score(prompt, b)
        if rng.random() < cl.bt_label_probability(sa, sb, temperature):
            chosen, rejected, sc, sr = a, b, sa, sb
        else:
            chosen, rejected, sc, sr = b, a, sb, sa
        pairs.append(
            PreferencePair(prompt, chosen, rejected, {"true_chosen": sc, "true_rejected": sr})
        )
    return pairs, dropped


# -------------------------------------------------------------------------- RM analysis


def rm_agreement(
    scorer: RewardModelScorer, pairs: Sequence[PreferencePair], temperature: float = 1.0
) -> dict[str, float]:
    """On held-out pairs: agreement with the noisy labels vs the noise ceiling
    E[max(p, 1 - p)], and accuracy against the truth on pairs with different true scores."""
    prompts = [p.prompt for p in pairs]
    rc = scorer.raw_scores(prompts, [p.chosen for p in pairs])
    rr = scorer.raw_scores(prompts, [p.rejected for p in pairs])
    agree = ((rc > rr).float() + 0.5 * (rc == rr).float()).tolist()
    sc = [float(p.extra["true_chosen"]) for p in pairs]
    sr = [float(p.extra["true_rejected"]) for p in pairs]
    differ = [i for i in range(len(pairs)) if sc[i] != sr[i]]
    truth_correct = [1.0 if (rc[i] > rr[i]) == (sc[i] > sr[i]) else 0.0 for i in differ]
    return {
        "label_agreement": sum(agree) / len(agree),
        "noise_ceiling": cl.noise_ceiling(list(zip(sc, sr, strict=True)), temperature),
        "truth_accuracy": sum(truth_correct) / max(len(truth_correct), 1),
        "truth_pairs": float(len(differ)),
        "pairs": float(len(pairs)),
    }


def probe_blind_spot(scorer: RewardModelScorer, n: int, seed: int) -> dict[str, Any]:
    """Shuffle the words of grammatical sentences (true score -> -3) and compare RM scores.

    Reports the mean normalised RM score of originals and shuffles, the fraction of sentences
    whose shuffle scores at least as high as the original (a faithful RM gives ~0), and the
    fraction of shuffles that beat the average grammatical sentence of the language.
    """
    lang = cl.CityLanguage(seed=seed + 17, length_weights=(0.0, 0.5, 0.5))
    rng = random.Random(seed + 23)
    originals = lang.sample_many(n)
    prompts = [p for p, _ in originals]
    orig = [c for _, c in originals]
    shuffled = [cl.shuffle_words(c, rng) for c in orig]
    r_orig = torch.tensor(scorer.score_batch(prompts, orig))
    r_shuf = torch.tensor(scorer.score_batch(prompts, shuffled))
    true_orig = torch.tensor([cl.true_score(p, c) for p, c in originals])
    true_shuf = torch.tensor([cl.true_score(p, c) for p, c in zip(prompts, shuffled, strict=True)])
    examples = [
        {
            "prompt": prompts[i],
            "original": orig[i],
            "shuffled": shuffled[i],
            "rm_original": round(float(r_orig[i]), 3),
            "rm_shuffled": round(float(r_shuf[i]), 3),
        }
        for i in range(min(5, n))
    ]
    return {
        "n": n,
        "rm_original_mean": float(r_orig.mean()),
        "rm_shuffled_mean": float(r_shuf.mean()),
        "true_original_mean": float(true_orig.mean()),
        "true_shuffled_mean": float(true_shuf.mean()),
        "shuffled_ge_original": float((r_shuf >= r_orig).float().mean()),
        "shuffled_above_mean_grammatical": float((r_shuf > r_orig.mean()).float().mean()),
        "rm_corr_original_shuffled": float(torch.corrcoef(torch.stack([r_orig, r_shuf]))[0, 1]),
        "examples": examples,
    }


# ---------------------------------------------------------------------- policy evaluation


@torch.no_grad()
def evaluate_policy(
    policy_path: str | Path,
    reference: torch.nn.Module,
    scorer: RewardModelScorer,
    prompts: Sequence[str],
    max_tokens: int,
    seed: int,
) -> dict[str, Any]:
    """Fresh samples from a policy (temperature 1): mean proxy (normalised RM) score, true
    score, grammatical and finished fractions, KL(pi || pi_ref) per sequence (k1, summed over
    tokens), distinct responses and distinct-1/2, and a few example completions."""
    tokenizer = load_tokenizer(policy_path)
    model = load_causal_lm(policy_path).eval()
    texts, p_ids, r_ids, logps = sample_completions(model, tokenizer, prompts, max_tokens, seed)
    proxy = scorer.score_batch(list(prompts), texts)
    verdicts = [cl.judge(p, t) for p, t in zip(prompts, texts, strict=True)]
    batch = pack_batch(p_ids, r_ids, tokenizer.pad_token_id)
    ref_lp, _ = forward_logprobs(reference.eval(), batch)
    behav = torch.zeros_like(ref_lp)
    for i, lp in enumerate(logps):
        behav[i, : len(lp)] = torch.as_tensor(lp)
    kl = ((behav - ref_lp) * batch.response_mask).sum(-1)
    counts: dict[str, int] = {}
    for t in texts:
        counts[t] = counts.get(t, 0) + 1
    top = sorted(counts.items(), key=lambda kv: -kv[1])[:5]
    n = len(texts)
    return {
        "proxy": sum(proxy) / n,
        "true": sum(v.score for v in verdicts) / n,
        "grammatical": sum(v.grammatical for v in verdicts) / n,
        "finished": sum(v.finished for v in verdicts) / n,
        "kl": float(kl.mean()),
        "distinct_responses": distinct_responses(texts),
        "distinct_1": distinct_n(texts, 1),
        "distinct_2": distinct_n(texts, 2),
        "length": float(batch.response_mask.sum(-1).mean()),
        "n": n,
        "top_completions": [{"completion": t, "count": c} for t, c in top],
    }
