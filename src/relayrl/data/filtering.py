"""Difficulty filtering by measured pass rate (``relayrl filter``).

Sample N completions per prompt with the current policy, score them, and take the pass rate
p = (# samples whose raw verifiable outcome >= ``pass_threshold``) / N. Prompts with
``low <= p <= high`` are kept (default [0.1, 0.9]: always-solved and never-solved prompts
teach a group-relative method nothing) and written with their pass rate and a bucket:
``hard`` (p < 1/3), ``medium`` (p < 2/3) or ``easy``.

``filter_by_pass_rate`` is the pure part; ``measure_pass_rates`` runs a ``RolloutEngine``
and a ``RewardService``; ``run_difficulty_filter`` does the whole command from a run config.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relayrl.data.jsonl import DataError, write_jsonl
from relayrl.data.prompts.tokens import TokenizedPrompt
from relayrl.data.records import PromptRecord

__all__ = [
    "FilterReport",
    "difficulty_bucket",
    "filter_by_pass_rate",
    "measure_pass_rates",
    "run_difficulty_filter",
]

BUCKET_EDGES = (1 / 3, 2 / 3)


def difficulty_bucket(rate: float, edges: tuple[float, float] = BUCKET_EDGES) -> str:
    """``hard`` below edges[0], ``medium`` below edges[1], else ``easy``."""
    if rate < edges[0]:
        return "hard"
    if rate < edges[1]:
        return "medium"
    return "easy"


@dataclass
class FilterReport:
    """Counts of one filtering run."""

    total: int = 0
    measured: int = 0
    skipped: int = 0
    kept: int = 0
    too_easy: int = 0
    too_hard: int = 0
    low: float = 0.1
    high: float = 0.9
    samples_per_prompt: int = 0
    buckets: dict[str, int] = field(default_factory=dict)
    output: str | None = None

    def message(self) -> str:
        return (
            f"kept {self.kept} of {self.measured} prompts with pass rate in "
            f"[{self.low:g}, {self.high:g}] ({self.too_easy} too easy, {self.too_hard} too hard"
            f"{f', {self.skipped} skipped as too long' if self.skipped else ''}); buckets "
            + ", ".join(f"{k} {v}" for k, v in sorted(self.buckets.items()))
        )


def filter_by_pass_rate(
    records: Sequence[PromptRecord],
    pass_rates: Sequence[float],
    low: float = 0.1,
    high: float = 0.9,
    edges: tuple[float, float] = BUCKET_EDGES,
) -> tuple[list[PromptRecord], FilterReport]:
    """Keep records with ``low <= rate <= high``; each kept record gets ``pass_rate`` and
    ``difficulty`` in ``extra`` (new records; the inputs are not modified)."""
    if len(records) != len(pass_rates):
        raise ValueError(f"{len(records)} records but {len(pass_rates)} pass rates")
    if not 0.0 <= low <= high <= 1.0:
        raise ValueError(f"need 0 <= low <= high <= 1, got low={low}, high={high}")
    report = FilterReport(total=len(records), measured=len(records), low=low, high=high)
    kept: list[PromptRecord] = []
    for rec, rate in zip(records, pass_rates, strict=True):
        if rate < low:
            report.too_hard += 1
            continue
        if rate > high:
            report.too_easy += 1
            continue
        bucket = difficulty_bucket(rate, edges)
        report.buckets[bucket] = report.buckets.get(bucket, 0) + 1
        extra = {**rec.extra, "pass_rate": float(rate), "difficulty": bucket}
        kept.append(dataclasses.replace(rec, extra=extra))
    report.kept = len(kept)
    return kept, report


def measure_pass_rates(
    engine: Any,
    prompts: Sequence[TokenizedPrompt],
    service: Any,
    n: int,
    *,
    max_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    stop_token_ids: Sequence[int] = (),
    seed: int = 0,
    pass_threshold: float = 1.0,
    chunk_prompts: int = 64,
) -> list[float]:
    """Pass rate of each prompt (its record and token ids) under ``engine``'s current policy.

    ``n`` seeded samples per prompt (seed from (seed, prompt index, k)); each is scored by
    ``service`` (a ``RewardService``); a sample passes when its raw ``outcome`` is
    >= ``pass_threshold``. Prompts go through the engine ``chunk_prompts`` at a time.
    """
    from relayrl.rollout import GenerationRequest, SamplingParams

    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    rates: list[float] = []
    for start in range(0, len(prompts), chunk_prompts):
        chunk = prompts[start : start + chunk_prompts]
        requests = []
        for j, p in enumerate(chunk):
            rec, ids = p.record, p.ids
            for k in range(n):
                s = (seed * 1_000_003 + (start + j) * n + k) & 0x7FFFFFFF
                params = SamplingParams(
                    temperature=temperature,
                    top_p=top_p,
                    max_tokens=max_tokens,
                    stop_token_ids=list(stop_token_ids),
                    seed=s,
                )
                requests.append(
                    GenerationRequest(
                        list(ids), params, group_id=start + j, metadata=rec.as_sample()
                    )
                )
        samples = engine.generate(requests)
        results = service.score_batch(samples)
        for j in range(len(chunk)):
            group = results[j * n : (j + 1) * n]
            rates.append(sum(r.outcome >= pass_threshold for r in group) / n)
    return rates


def run_difficulty_filter(
    cfg: Any,
    input_path: str | Path | None,
    output_path: str | Path,
    n: int = 8,
    low: float = 0.1,
    high: float = 0.9,
) -> FilterReport:
    """``relayrl filter``: measure pass rates of ``cfg.model.path`` on a prompt dataset and
    write those within [low, high] (with ``pass_rate`` and ``difficulty``) as JSONL.

    ``cfg`` is a ``RunConfig``: model, ``rollout`` sampling settings, ``reward`` (its
    verifiable outcome decides a pass), ``data`` (``max_prompt_tokens``, the source keys and
    chat template). ``input_path`` defaults to ``cfg.data.train_path``.
    """
    import torch

    from relayrl.data.prompts.tasks import read_rows
    from relayrl.data.prompts.tokens import tokenize_prompts
    from relayrl.model import load_causal_lm, load_tokenizer, set_threads
    from relayrl.reward.service import build_reward_service
    from relayrl.rollout import RolloutEngine

    if input_path is None:
        input_path = cfg.data.train_path
    if input_path is None:
        raise ValueError("relayrl filter: give --input or set data.train_path")
    src = cfg.data.source
    records = read_rows(src, str(input_path))
    set_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    tokenizer = load_tokenizer(cfg.model.path)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}[
        cfg.model.dtype
    ]
    model = load_causal_lm(cfg.model.path, dtype).eval().requires_grad_(False)
    engine = RolloutEngine(
        model,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        max_slots=cfg.rollout.max_slots,
        seed=cfg.seed,
    )
    prompts, skip = tokenize_prompts(
        records, tokenizer, cfg.data.max_prompt_tokens, src.chat_template, src.system_prompt
    )
    if not prompts:
        raise DataError(skip.why_none(str(input_path)))
    room = engine.max_model_len - cfg.rollout.max_tokens
    over = [len(p.ids) for p in prompts if len(p.ids) > room]
    if over:  # the engine would cut their answers short without a word
        raise DataError(
            f"{len(over)} of {len(prompts)} prompts in {input_path} are longer than {room} "
            f"tokens, which leaves no room for rollout.max_tokens={cfg.rollout.max_tokens} in "
            f"the {engine.max_model_len}-token context of model.path {cfg.model.path} "
            f"(longest {max(over)}): set data.max_prompt_tokens <= {room}"
        )
    if skip.skipped:
        print(skip.message())
    stop = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    with build_reward_service(cfg.reward, tokenizer=tokenizer, force=True) as service:
        rates = measure_pass_rates(
            engine,
            prompts,
            service,
            n,
            max_tokens=cfg.rollout.max_tokens,
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            stop_token_ids=stop,
            seed=cfg.seed,
        )
    kept, report = filter_by_pass_rate([p.record for p in prompts], rates, low, high)
    report.total = len(records)
    report.skipped = skip.skipped
    report.samples_per_prompt = n
    write_jsonl(output_path, kept)
    report.output = str(output_path)
    return report
