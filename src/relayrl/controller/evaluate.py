"""Held-out evaluation: pass rate, pass@k and maj@k of the current policy.

One code path for ``relayrl eval`` and the evals inside training (``eval.*`` in the run
config, ``relayrl.config.eval``). Each prompt gets ``n`` answers (greedy when ``n`` is 1, the
default), each answer is scored by the run's reward and counts as correct when its verifiable
outcome is >= 1.

- pass@k, the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models
  Trained on Code", eq. 1): with c correct among n answers of a prompt,
  ``pass@k = 1 - C(n - c, k) / C(n, k)``, averaged over prompts. Computed as the product
  ``1 - prod_{i = n - c + 1}^{n} (1 - k / i)`` (no huge binomials); it is 1 when
  ``n - c < k``. pass@1 is the mean fraction correct.
- maj@k: in a set of k answers the answer given most often (answers read by ``eval.answer``;
  unreadable ones do not vote; ties go to the answer seen first) is the set's answer. A
  prompt's maj@k is the fraction of its k-answer subsets whose voted answer is correct (all
  C(n, k) subsets, or 2000 seeded random ones when there are more), averaged over prompts:
  maj@n is the plain vote of all n answers, maj@1 the fraction of answers correct.

Inside training the evaluation is watched by the stall watchdog (``controller.watchdog``):
``evaluate_prompts`` marks its phases (generating, scoring, each retry round) and
:func:`eval_progress` reads what moves within one (the engine's generated tokens and finished
requests, the reward role's scored samples).
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relayrl.config import DataConfig
from relayrl.config.eval import EvalConfig
from relayrl.controller.failures import infra_cause, retry_failed
from relayrl.controller.watchdog import no_mark
from relayrl.data.prompts import PromptSource, TokenizedPrompt
from relayrl.reward import Scorer, answers_equal, extract_final_answer, extract_integer_answer
from relayrl.reward.functions import fn_name
from relayrl.rollout import GenerationRequest, RolloutBackend, SamplingParams

__all__ = [
    "HELD_OUT",
    "EvalResult",
    "answer_reader",
    "eval_datasets",
    "eval_progress",
    "evaluate_prompts",
    "greedy_pass_rate",
    "held_out_metrics",
    "maj_at_k",
    "majority_vote",
    "pass_at_k",
]

HELD_OUT = "held-out"
"""Dataset name of the run config's own held-out set (``data.eval_path`` or the task's)."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with ``c`` correct among ``n`` answers (Chen et al. 2021):
    ``1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n - c + 1}^{n} (1 - k / i)``; 1 if ``n - c < k``.
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def majority_vote(
    answers: Sequence[str | None], same: Callable[[str, str], bool] | None = None
) -> int | None:
    """Index of the first answer of the most frequent answer, None when none was read.

    ``same(a, b)`` says two answers agree (default: equal strings). Ties go to the answer
    seen first."""
    cls = _classes(answers, same)
    counts: dict[int, int] = {}
    first: dict[int, int] = {}
    for i, c in enumerate(cls):
        if c is not None:
            counts[c] = counts.get(c, 0) + 1
            first.setdefault(c, i)
    if not counts:
        return None
    return first[max(counts, key=lambda c: (counts[c], -first[c]))]


def _classes(
    answers: Sequence[str | None], same: Callable[[str, str], bool] | None
) -> list[int | None]:
    """Class id per answer (None: unreadable): each answer joins the first class whose first
    answer equals it or, with ``same``, agrees with it."""
    reps: list[str] = []
    out: list[int | None] = []
    for ans in answers:
        if ans is None:
            out.append(None)
            continue
        for j, rep in enumerate(reps):
            if ans == rep or (same is not None and same(ans, rep)):
                out.append(j)
                break
        else:
            reps.append(ans)
            out.append(len(reps) - 1)
    return out


def maj_at_k(
    answers: Sequence[str | None],
    correct: Sequence[bool],
    k: int,
    same: Callable[[str, str], bool] | None = None,
    max_subsets: int = 2000,
    seed: int = 0,
) -> float:
    """maj@k of one prompt: over the k-answer subsets of its n answers, the fraction whose
    majority answer (ties: the one seen first) is correct; 0 for a subset with no readable
    answer. All C(n, k) subsets when there are at most ``max_subsets``, else that many drawn
    at random (seeded). maj@n is the vote of all answers; maj@1 is the fraction correct among
    the readable answers' share."""
    n = len(answers)
    if not 1 <= k <= n or len(correct) != n:
        raise ValueError(f"maj@k needs 1 <= k <= n and one outcome per answer (n={n}, k={k})")
    cls = _classes(answers, same)
    if math.comb(n, k) <= max_subsets:
        subsets: Iterable[Sequence[int]] = itertools.combinations(range(n), k)
    else:
        rng = random.Random(seed)
        subsets = (sorted(rng.sample(range(n), k)) for _ in range(max_subsets))
    hits = total = 0
    for subset in subsets:
        total += 1
        counts: dict[int, int] = {}
        first: dict[int, int] = {}
        for i in subset:
            c = cls[i]
            if c is not None:
                counts[c] = counts.get(c, 0) + 1
                first.setdefault(c, i)
        if counts:
            winner = max(counts, key=lambda c: (counts[c], -first[c]))
            hits += bool(correct[first[winner]])
    return hits / total


def _integer(text: str) -> str | None:
    value = extract_integer_answer(text)
    return None if value is None else str(value)


def _text(text: str) -> str | None:
    return text.strip() or None


def answer_reader(
    kind: str, reward_fn: str = ""
) -> tuple[Callable[[str], str | None], Callable[[str, str], bool] | None]:
    """(read the answer of a completion, do two answers agree) for ``eval.answer``."""
    if kind == "auto":
        kind = {"arithmetic": "integer", "math": "math"}.get(reward_fn, "text")
    if kind == "integer":
        return _integer, None
    if kind == "math":
        return extract_final_answer, answers_equal
    if kind == "text":
        return _text, None
    raise ValueError(f"eval.answer: unknown answer reader {kind!r}")


@dataclass
class EvalResult:
    """``metrics``: pass@k / maj@k per k, ``pass_rate`` (mean fraction correct),
    ``reward_mean``, ``prompts``, ``n``; ``samples``: one record per answer."""

    metrics: dict[str, float]
    samples: list[dict[str, Any]] = field(default_factory=list)


def evaluate_prompts(
    engine: RolloutBackend,
    reward: Scorer,
    prompts: Sequence[TokenizedPrompt],
    max_tokens: int,
    stop_token_ids: list[int] | None = None,
    cfg: EvalConfig | None = None,
    reward_fn: str = "",
    retries: int = 0,
    mark: Callable[[str], None] = no_mark,
) -> EvalResult:
    """Generate ``cfg.n`` answers per prompt, score them, and compute the metrics above.

    An infrastructure failure (``controller.failures``) is generated and scored again up to
    ``retries`` times; what still fails counts as not correct and in ``failures/infra``.
    ``mark`` names each phase for a stall watchdog."""
    cfg = cfg or EvalConfig()
    n = cfg.n
    read, same = answer_reader(cfg.answer, reward_fn)
    requests = []
    for i, p in enumerate(prompts):
        for j in range(n):
            params = SamplingParams(
                greedy=cfg.is_greedy,
                temperature=cfg.temperature,
                top_p=cfg.top_p,
                max_tokens=cfg.max_tokens or max_tokens,
                stop_token_ids=list(stop_token_ids or []),
                seed=None if cfg.seed is None else cfg.seed + i * n + j,
            )
            requests.append(GenerationRequest(p.ids, params, metadata=p.fields()))
    mark(f"{type(engine).__name__} generating {len(requests)} requests")
    samples = engine.generate(requests)
    mark(f"{_scorer_name(reward)} scoring {len(samples)} samples")
    scores, _ = reward.score(samples)
    samples, scores, _ = retry_failed(engine, reward, requests, samples, scores, retries, mark)
    outcomes = reward.outcomes(samples, scores).tolist()
    score_list = scores.tolist()
    records: list[dict[str, Any]] = []
    sums = {f"pass@{k}": 0.0 for k in cfg.ks} | {f"maj@{k}": 0.0 for k in cfg.ks}
    for i, p in enumerate(prompts):
        rows = range(i * n, (i + 1) * n)
        texts = [reward.decode(samples[r]) for r in rows]
        answers = [read(t) for t in texts]
        correct = [outcomes[r] >= 1.0 for r in rows]
        c = sum(correct)
        for k in cfg.ks:
            sums[f"pass@{k}"] += pass_at_k(n, c, k)
            sums[f"maj@{k}"] += maj_at_k(answers, correct, k, same)
        for j, r in enumerate(rows):
            s = samples[r]
            records.append(
                {
                    "prompt_index": i,
                    "sample_index": j,
                    "prompt": p.record.prompt,
                    "reference": p.record.answer,
                    "completion": texts[j],
                    "extracted": answers[j],
                    "score": score_list[r],
                    "outcome": outcomes[r],
                    "correct": correct[j],
                    "response_tokens": len(s.response_ids),
                    "finish_reason": s.finish_reason,
                    "failure": infra_cause(s),
                }
            )
    m = max(len(prompts), 1)
    metrics = {key: value / m for key, value in sums.items()}
    metrics["pass_rate"] = sum(r["correct"] for r in records) / max(len(records), 1)
    metrics["reward_mean"] = float(scores.mean()) if len(score_list) else 0.0
    metrics["prompts"] = float(len(prompts))
    metrics["n"] = float(n)
    metrics["failures/infra"] = float(sum(r["failure"] is not None for r in records))
    versions = [v for s in samples for v in s.versions]
    if versions:  # the policy versions the answers came from (an async eval may span some)
        metrics["version_min"], metrics["version_max"] = float(min(versions)), float(max(versions))
    return EvalResult(metrics, records)


def held_out_metrics(
    engine: RolloutBackend,
    reward: Scorer,
    prompts: Sequence[TokenizedPrompt],
    max_tokens: int,
    stop_token_ids: list[int] | None = None,
    cfg: EvalConfig | None = None,
    reward_fn: str = "",
    retries: int = 0,
    mark: Callable[[str], None] = no_mark,
) -> dict[str, float]:
    """The eval inside training: ``eval/pass_rate``, ``eval/reward_mean``, ``eval/n`` (prompts)
    and, when ``cfg.n`` > 1, ``eval/pass@k`` and ``eval/maj@k`` for each k. ``mark``: each
    phase, for a stall watchdog."""
    cfg = cfg or EvalConfig()
    out = evaluate_prompts(
        engine, reward, prompts, max_tokens, stop_token_ids, cfg, reward_fn, retries, mark
    )
    metrics = {
        "eval/failures/infra": out.metrics["failures/infra"],
        **{f"eval/{k}": out.metrics[k] for k in ("version_min", "version_max") if k in out.metrics},
        "eval/pass_rate": out.metrics["pass_rate"],
        "eval/reward_mean": out.metrics["reward_mean"],
        "eval/n": out.metrics["prompts"],
    }
    if cfg.n > 1:
        for k in cfg.ks:
            metrics[f"eval/pass@{k}"] = out.metrics[f"pass@{k}"]
            metrics[f"eval/maj@{k}"] = out.metrics[f"maj@{k}"]
    return metrics


def eval_progress(engine: RolloutBackend, reward: Scorer) -> Callable[[], Hashable]:
    """A stall watchdog's probe of an evaluation: (tokens ``engine`` generated, requests it
    finished, samples ``reward`` scored), counters that only grow. Progress of the evaluation
    only while nothing else uses the engine (between sync steps; a replica of its own)."""

    def probe() -> Hashable:
        counters = engine.report().counters
        return (
            int(counters.get("tokens_generated", 0)),
            int(counters.get("requests_finished", 0)),
            reward.progress(),
        )

    return probe


def _scorer_name(reward: Scorer) -> str:
    """What scores: ``the reward service`` or ``reward function <module.name>``."""
    if reward.service is not None:
        return "the reward service"
    fn = getattr(reward, "fn", None)
    return f"reward function {fn_name(fn)}" if fn is not None else type(reward).__name__


def greedy_pass_rate(
    engine: RolloutBackend,
    reward: Scorer,
    prompts: Sequence[TokenizedPrompt],
    max_tokens: int,
    stop_token_ids: list[int] | None = None,
) -> dict[str, float]:
    """Fraction of prompts whose greedy completion scores >= 1 (a verified correct answer)."""
    return held_out_metrics(engine, reward, prompts, max_tokens, stop_token_ids, EvalConfig())


def eval_datasets(
    data: DataConfig, tokenizer: Any, seed: int, paths: Sequence[str] = ()
) -> list[tuple[str, list[TokenizedPrompt]]]:
    """(name, prompts) per dataset: each path (JSONL, Parquet, a saved ``datasets`` dir) read
    as ``data.eval_path`` would be (first ``data.eval_size`` rows, ``data.source`` keys), or
    the config's own held-out set for the name ``held-out`` / no paths. Names are the file
    stems, made unique."""
    out: list[tuple[str, list[TokenizedPrompt]]] = []
    seen: dict[str, int] = {}
    for path in paths or [HELD_OUT]:
        if path == HELD_OUT:
            cfg, name = data, HELD_OUT
        else:
            if not Path(path).exists():
                raise FileNotFoundError(f"eval dataset {path} does not exist")
            cfg, name = data.model_copy(update={"eval_path": path}), Path(path).stem
        seen[name] = seen.get(name, 0) + 1
        if seen[name] > 1:
            name = f"{name}-{seen[name]}"
        out.append((name, PromptSource(cfg, tokenizer, seed, with_train=False).eval_set()))
    return out
