"""Tinker ``sample`` requests on a relayrl engine: SamplingParams mapping, stop sequences,
prompt logprobs (``compute_logprobs``; ``prompt_logprobs_last_n`` n: the first
len(prompt) - n entries are None), top-k logprobs of the prompt and of the sampled tokens
(``topk_prompt_logprobs``, ``topk_sample_logprobs``: :mod:`relayrl.tinker.topk`).

SamplingParams -> relayrl's: ``temperature`` (0 = greedy; < 0 a user error), ``top_p``,
``top_k`` (-1 or 0 = off; < -1 a user error),
``max_tokens`` (None or more than the context leaves: up to the context), ``seed`` (sample
``i`` of ``num_samples`` gets ``seed + i``). ``stop``: token ids replace the default stop (EOS);
``[]`` disables every stop, EOS included; strings are matched on the decoded text after
generation (EOS still stops) and the sequence is cut after the first token that completes
one. A prompt longer than the context is a user error; one exactly as long is served only
with its prompt logprobs (or their top-k) asked for (``compute_logprobs``: the prompt's
forward needs no room),
its ``num_samples`` sequences empty (stop reason ``length``), else a user error (no room to
sample). Logprobs are the engine's behaviour logprobs: the sampled token under the
distribution it was drawn from (temperature-scaled; at temperature 1 the trainer's recompute,
within fp32).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from relayrl.rollout.engine import RolloutEngine
from relayrl.rollout.types import GenerationRequest, Sample, SamplingParams
from relayrl.tinker.topk import ordered, prompt_scores
from relayrl.tinker.wire import WireSequence, encode_sample_response


@dataclass
class SampleJob:
    """One ``/api/v1/asample`` request."""

    sampler_id: str
    prompt: list[int]
    num_samples: int
    params: dict[str, Any]
    prompt_logprobs: bool = False
    prompt_logprobs_last_n: int | None = None
    """Score only the prompt's last n tokens (1..len(prompt) - 1); earlier entries None."""
    topk_prompt: int = 0
    """``topk_prompt_logprobs``: the k most likely tokens per prompt position (0: off)."""
    topk_sample: int = 0
    """``topk_sample_logprobs``: the k most likely tokens per sampled position (0: off)."""

    @property
    def scores_prompt(self) -> bool:
        """The prompt's own forward is asked for (prompt logprobs or their top-k)."""
        return self.prompt_logprobs or self.topk_prompt > 0


def _stop_rule(stop: Any) -> tuple[list[int], bool, list[str]]:
    """(stop_token_ids, ignore_eos, stop_strings) of the request's ``stop``."""
    if stop is None:
        return [], False, []
    if isinstance(stop, str):
        return [], False, [stop]
    stop = list(stop)
    if all(isinstance(s, int) for s in stop):
        return [int(s) for s in stop], True, []
    if all(isinstance(s, str) for s in stop):
        return [], False, [s for s in stop if s]
    raise ValueError(f"stop must be a string, a list of strings or a list of token ids: {stop!r}")


def _cut_at_stop(sample: Sample, tokenizer: Any, stops: list[str]) -> tuple[int, bool]:
    """(tokens to keep, stopped by a string) for string stops."""
    ids = sample.response_ids
    if not stops or not any(s in tokenizer.decode(ids) for s in stops):
        return len(ids), False
    for k in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:k])
        if any(s in text for s in stops):
            return k, True
    return len(ids), False


def run_sample_jobs(
    engine: RolloutEngine, tokenizer: Any, jobs: list[SampleJob], user_error: type[Exception]
) -> list[bytes | Exception]:
    """Generate every job's samples in one engine batch; an encoded SampleResponse per job
    (or the job's error)."""
    out: list[bytes | Exception | None] = [None] * len(jobs)
    requests: list[GenerationRequest] = []
    owners: list[int] = []
    rules: dict[int, list[str]] = {}
    prompt_only_jobs: set[int] = set()
    ctx = engine.max_model_len
    for j, job in enumerate(jobs):
        p = job.params
        try:
            if not job.prompt:
                raise user_error("the prompt is empty")
            if len(job.prompt) > ctx:
                raise user_error(
                    f"the prompt has {len(job.prompt)} tokens, longer than the model's "
                    f"context of {ctx}"
                )
            # a prompt that fills the context leaves no room to sample: served (no token
            # generated) only when its prompt logprobs are asked for (compute_logprobs)
            prompt_only = len(job.prompt) == ctx
            if prompt_only and not job.scores_prompt:
                raise user_error(
                    f"the prompt has {len(job.prompt)} tokens; the model's context is {ctx}, "
                    "leaving no room to sample"
                )
            if max(job.prompt) >= engine.input_vocab or min(job.prompt) < 0:
                raise user_error(
                    f"a prompt token id is outside the vocabulary (0..{engine.input_vocab - 1})"
                )
            last_n = job.prompt_logprobs_last_n
            if last_n is not None and not 1 <= last_n <= len(job.prompt) - 1:
                raise user_error(
                    f"prompt_logprobs_last_n must be 1..{len(job.prompt) - 1} (the prompt's "
                    f"length - 1), got {last_n}"
                )
            if not 1 <= job.num_samples <= 1024:
                raise user_error(f"num_samples must be 1..1024, got {job.num_samples}")
            ids, ignore_eos, strings = _stop_rule(p.get("stop"))
            room = ctx - len(job.prompt)
            max_tokens = p.get("max_tokens")
            max_tokens = room if max_tokens is None else min(int(max_tokens), room)
            if max_tokens < 1 and not prompt_only:
                raise user_error(f"max_tokens must be >= 1, got {p.get('max_tokens')}")
            temperature = float(p.get("temperature", 1.0))
            if not temperature >= 0:  # NaN too
                raise user_error(f"temperature must be >= 0 (0: greedy), got {temperature}")
            top_k = int(p.get("top_k", -1))
            if top_k < -1:
                raise user_error(f"top_k must be -1 or 0 (off) or >= 1, got {top_k}")
            seed = p.get("seed")
        except (ValueError, TypeError) as e:
            out[j] = e if isinstance(e, user_error) else user_error(str(e))
            continue
        rules[j] = strings
        if prompt_only:
            prompt_only_jobs.add(j)  # its num_samples sequences are empty: nothing generated
            continue
        for i in range(job.num_samples):
            params = SamplingParams(
                temperature=temperature if temperature > 0 else 1.0,
                greedy=temperature <= 0,
                top_p=float(p.get("top_p", 1.0)),
                top_k=top_k if top_k > 0 else 0,
                max_tokens=max_tokens,
                stop_token_ids=ids,
                ignore_eos=ignore_eos,
                seed=None if seed is None else int(seed) + i,
                top_logprobs=job.topk_sample,
            )
            requests.append(GenerationRequest(list(job.prompt), params))
            owners.append(j)
    samples = engine.generate(requests) if requests else []
    per_job: dict[int, list[Sample]] = {j: [] for j in rules}
    for j, s in zip(owners, samples, strict=True):
        per_job.setdefault(j, []).append(s)
    for j, group in per_job.items():
        errors = [s.error for s in group if s.error]
        if errors:
            out[j] = user_error(errors[0])
            continue
        seqs = [WireSequence([], [], False) for _ in range(jobs[j].num_samples)]
        seqs = seqs if j in prompt_only_jobs else []
        for s in group:
            keep, by_string = _cut_at_stop(s, tokenizer, rules[j])
            top = s.top_logprobs or []
            seqs.append(
                WireSequence(
                    s.response_ids[:keep],
                    s.behaviour_logprobs[:keep],
                    stopped=by_string or s.finish_reason in ("eos", "stop"),
                    topk=None if s.top_logprobs is None else [ordered(r) for r in top[:keep]],
                )
            )
        job = jobs[j]
        plp, prompt_top = None, None
        if job.scores_prompt:
            plp, prompt_top = prompt_scores(
                engine.model, job.prompt, job.topk_prompt, job.prompt_logprobs_last_n
            )
        plp = plp if job.prompt_logprobs else None
        out[j] = encode_sample_response(seqs, plp, prompt_top, (job.topk_prompt, job.topk_sample))
    return [o if o is not None else user_error("no result") for o in out]
