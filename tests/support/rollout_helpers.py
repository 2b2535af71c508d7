"""Shared helpers for the rollout tests: tiny models and reference computations."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from relayrl.model.loading import load_causal_lm
from relayrl.model.tiny import build_tiny_model
from relayrl.rollout import GenerationRequest, Sample, SamplingParams
from relayrl.rollout.sampler import _filter_top_k_top_p

PAD, EOS = 0, 2


def tiny_model(root: Path, arch: str, seed: int = 0, **kw: object) -> torch.nn.Module:
    """Build (once per directory) and load a tiny random model."""
    out = root / f"{arch}-{seed}"
    if not (out / "config.json").exists():
        build_tiny_model(out, arch=arch, seed=seed, **kw)  # type: ignore[arg-type]
    return load_causal_lm(out).eval()


def random_prompts(lengths: list[int], seed: int = 0, lo: int = 4, hi: int = 80) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(lo, hi, (n,), generator=g).tolist() for n in lengths]


@torch.no_grad()
def recompute_logprobs(
    model: torch.nn.Module, prompt: list[int], response: list[int], temperature: float = 1.0
) -> torch.Tensor:
    """Per-token logprobs of ``response`` by one plain unpadded forward (the trainer's view)."""
    ids = torch.tensor([prompt + response])
    logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1 : -1].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(1, torch.tensor(response).unsqueeze(1)).squeeze(1)


@torch.no_grad()
def hf_greedy(
    model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """``transformers`` ``generate(do_sample=False)`` on a left-padded batch; responses cut
    after the first EOS (which is kept)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    out = model.generate(
        ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )
    res = []
    for row in out[:, width:].tolist():
        if EOS in row:
            row = row[: row.index(EOS) + 1]
        res.append(row)
    return res


TOP_PARAMS: list[dict[str, Any]] = [
    dict(greedy=True, top_logprobs=3),
    dict(temperature=0.7, top_k=5, top_p=0.9, top_logprobs=4),
    dict(temperature=1.3, top_logprobs=20),
    dict(temperature=1.0, top_logprobs=0),
]
"""Requests for :func:`check_top_recompute`: greedy, filtered, the most alternatives, none."""


@torch.no_grad()
def recompute_top(
    model: torch.nn.Module, prompt: list[int], response: list[int], params: dict[str, Any]
) -> list[list[tuple[int, float]]]:
    """Each response token's ``params["top_logprobs"]`` alternatives by one plain forward: the
    top k of ``log_softmax(top_p(top_k(logits / temperature)))`` (greedy: ``log_softmax(logits)``;
    the own sampler's filters), tokens the filters removed left out."""
    ids = torch.tensor([prompt + response])
    logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1 : -1].float()
    if not params.get("greedy"):
        n = len(response)
        x = logits / params.get("temperature", 1.0)
        logits = _filter_top_k_top_p(
            x, [params.get("top_k", 0)] * n, [params.get("top_p", 1.0)] * n
        )
    best = torch.log_softmax(logits, -1).topk(params["top_logprobs"], -1)
    return [
        [(t, v) for t, v in zip(i, vs, strict=True) if v != float("-inf")]
        for i, vs in zip(best.indices.tolist(), best.values.tolist(), strict=True)
    ]


def check_top_recompute(
    model: torch.nn.Module,
    generate: Callable[[list[GenerationRequest]], list[Sample]],
    tol: float = 1e-4,
) -> None:
    """``TOP_PARAMS`` on 8 prompts through ``generate``: each asking sample lists, per token,
    the recomputed alternatives (the same tokens, most likely first, logprobs within ``tol``);
    one that does not ask has none; the same requests without alternatives give the same
    tokens and behaviour logprobs (asking changes nothing sampled)."""
    prompts = random_prompts([4, 9, 2, 12, 6, 3, 7, 5], seed=7)

    def requests(asked: bool) -> list[GenerationRequest]:
        out = []
        for i, p in enumerate(prompts):
            kw = TOP_PARAMS[i % len(TOP_PARAMS)]
            kw = kw if asked else {**kw, "top_logprobs": 0}
            out.append(GenerationRequest(p, SamplingParams(max_tokens=16, seed=i, **kw)))
        return out

    asked, plain = generate(requests(True)), generate(requests(False))
    for i, (p, a, b) in enumerate(zip(prompts, asked, plain, strict=True)):
        params = TOP_PARAMS[i % len(TOP_PARAMS)]
        assert a.response_ids == b.response_ids and a.behaviour_logprobs == b.behaviour_logprobs
        assert b.top_logprobs is None
        if not params["top_logprobs"]:
            assert a.top_logprobs is None
            continue
        want = recompute_top(model, p, a.response_ids, params)
        assert a.top_logprobs is not None and len(a.top_logprobs) == len(want)
        for got, ref in zip(a.top_logprobs, want, strict=True):
            assert [t for t, _ in got] == [t for t, _ in ref]
            assert [v for _, v in got] == pytest.approx([v for _, v in ref], abs=tol)
