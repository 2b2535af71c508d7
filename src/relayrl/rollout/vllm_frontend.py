"""What both vLLM backends share: the in-process engine (:mod:`relayrl.rollout.vllm_backend`)
and the server process (:mod:`relayrl.rollout.vllm_server`) hold the same per-request record,
validate requests and weights the same way, resubmit a request with the same seed rule and
hand back the same samples; they differ in how a request reaches vLLM (``_send``) and how its
answers come back (``step``).

Alternatives (``SamplingParams.top_logprobs = k``): a submission asks vLLM for ``logprobs = k``
(the sampled token's logprob and the top ``k``, under the processed distribution: both
backends start vLLM with ``logprobs_mode="processed_logprobs"``); each position's answer
becomes our ``(token id, logprob)`` list with :func:`relayrl.rollout.top_logprobs.from_ranked`
and is kept in ``LiveRequest.seq.top`` (``None`` when not asked, as the built-in engine's
``Sequence.top``). The sampled token's logprob, the behaviour logprob, is read as before.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from relayrl.rollout.engine import (
    InvalidRequestError,
    RolloutEngine,
    run_until_done,
)
from relayrl.rollout.sampler import _splitmix64
from relayrl.rollout.scheduler import Sequence
from relayrl.rollout.types import (
    EngineReport,
    FinishReason,
    GenerationRequest,
    Sample,
    error_sample,
)


@dataclass
class LiveRequest:
    """A submitted request and what vLLM produced for it so far."""

    seq: Sequence  # validated request, normalised sampling settings, clipped max_tokens
    vllm_id: str = ""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    kv_kept_at: list[int] = field(default_factory=list)
    num_interrupts: int = 0
    submissions: int = 0
    aborted: bool = False


def model_shapes(config: Any) -> tuple[dict[str, tuple[int, ...]], int, int]:
    """(parameter shapes by HF name, input vocabulary, output vocabulary) of ``config``'s
    model, built on the meta device (no memory)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    shapes = {k: tuple(v.shape) for k, v in meta.state_dict().items()}
    return (
        shapes,
        int(meta.get_input_embeddings().num_embeddings),
        int(meta.get_output_embeddings().out_features),
    )


def next_submission(live: LiveRequest, eos_token_id: int) -> tuple[list[int], dict[str, Any]]:
    """The prompt (prompt + tokens so far) and vLLM sampling fields of ``live``'s next
    submission, with its fresh vLLM id set. A resubmission continues the request's random
    stream at ``splitmix64(seed ^ n * golden)`` (``n`` tokens so far); EOS ends the request
    through ``stop_token_ids`` (``ignore_eos`` stays on). ``top_k`` is the caller's: the two
    front ends spell "off" differently."""
    s, seq = live.seq.settings, live.seq
    n = len(live.tokens)
    stop = set(seq.stop_ids) | ({eos_token_id} if seq.stop_on_eos else set())
    seed = s.seed if n == 0 else _splitmix64(s.seed ^ (n * 0x9E3779B97F4A7C15))
    live.vllm_id = f"{seq.request_id}.{live.submissions}"
    live.submissions += 1
    fields = {
        "n": 1,
        "temperature": 0.0 if s.greedy else s.temperature,
        "top_p": s.top_p,
        "max_tokens": seq.max_tokens - n,
        "seed": seed & 0x7FFFFFFFFFFFFFFF,
        "stop_token_ids": sorted(stop),
        "ignore_eos": True,
        "logprobs": seq.request.params.top_logprobs,  # 0: the sampled token's only
        "detokenize": False,
    }
    return seq.tokens[: seq.prompt_len] + live.tokens, fields


class VllmFrontend:
    """The request, weight-check and sample plumbing of a vLLM backend. A subclass sets the
    attributes below in its ``__init__`` and provides ``_send`` (hand ``live`` to vLLM) and
    ``step``/``stats``."""

    supports_top_logprobs = True  # ``SamplingParams.top_logprobs`` (see module)
    eos_token_id: int
    version: int
    _ids: Iterator[int]
    _live: dict[int, LiveRequest]
    _held: list[int]
    _deferred: tuple[dict[str, Tensor], int] | None
    _finished: list[Sample]
    _shapes: dict[str, tuple[int, ...]]
    _stats: dict[str, float]

    def _send(self, live: LiveRequest) -> None:
        raise NotImplementedError

    def step(self) -> list[Sample]:
        raise NotImplementedError

    def stats(self) -> dict[str, Any]:
        raise NotImplementedError

    # ------------------------------------------------------------------ requests
    def submit(self, request: GenerationRequest) -> int:
        """Queue a request; returns its id. Raises InvalidRequestError on bad input."""
        rid = next(self._ids)
        self._register(rid, request)
        return rid

    def submit_many(self, requests: Iterable[GenerationRequest]) -> list[int]:
        return [self.submit(r) for r in requests]

    def _register(self, rid: int, request: GenerationRequest) -> None:
        seq = RolloutEngine._make_sequence(self, rid, request)  # type: ignore[arg-type]
        self._live[rid] = live = LiveRequest(seq)
        self._stats["requests_submitted"] += 1
        if self._deferred is not None:  # submitted while a no-interrupt update waits
            self._held.append(rid)
        else:
            self._send(live)

    def has_unfinished(self) -> bool:
        return bool(self._live) or bool(self._finished)

    def drain(self) -> list[Sample]:
        out: list[Sample] = []
        while self.has_unfinished():
            out.extend(self.step())
        return out

    def iter_finished(self) -> Iterator[Sample]:
        while self.has_unfinished():
            yield from self.step()

    def generate(self, requests: list[GenerationRequest]) -> list[Sample]:
        """Run ``requests`` to completion; samples in request order (a bad request yields an
        ``'abort'`` sample with ``error`` set in its place), as the built-in engine."""
        results: dict[int, Sample] = {}
        order: list[int] = []
        for req in requests:
            rid = next(self._ids)
            try:
                self._register(rid, req)
            except InvalidRequestError as e:
                results[rid] = error_sample(rid, req, str(e))
            order.append(rid)
        return run_until_done(self.step, order, results, self._finished)

    def prioritize(self, group_ids: Iterable[int]) -> None:
        """Accepted for interface parity; vLLM cannot re-prioritise running requests."""

    # ------------------------------------------------------------------ weights
    def _begin_update(
        self, state_dict: Mapping[str, Tensor], version: int, strict: bool
    ) -> dict[str, Tensor]:
        """The checks and bookkeeping every update starts with; returns the state as a dict."""
        if version == self.version:
            raise ValueError(f"weights are already version {version}")
        state = dict(state_dict)
        self._check_state_dict(state, strict)
        self._stats["weight_updates"] += 1
        self.version = version
        return state

    def _take_held(self) -> list[int]:
        held, self._held = self._held, []
        return held

    def _check_state_dict(self, state: dict[str, Tensor], strict: bool) -> None:
        unexpected = sorted(set(state) - set(self._shapes))
        missing = sorted(set(self._shapes) - set(state))
        if strict and (unexpected or missing):
            raise ValueError(
                f"state_dict does not match the model: unexpected keys {unexpected[:5]}, "
                f"missing keys {missing[:5]}"
            )
        for name, tensor in state.items():
            if name in self._shapes and tuple(tensor.shape) != self._shapes[name]:
                raise ValueError(
                    f"state_dict[{name!r}] has shape {tuple(tensor.shape)}, "
                    f"the model expects {self._shapes[name]}"
                )

    # ------------------------------------------------------------------ reporting
    def report(self) -> EngineReport:
        return EngineReport(self.stats())

    def _to_sample(self, live: LiveRequest, reason: FinishReason) -> Sample:
        seq, req = live.seq, live.seq.request
        meta = dict(req.metadata)
        if live.kv_kept_at:
            meta["kv_kept_at"] = list(live.kv_kept_at)
        return Sample(
            request_id=seq.request_id,
            prompt_ids=seq.tokens[: seq.prompt_len],
            response_ids=live.tokens,
            behaviour_logprobs=live.logprobs,
            versions=live.versions,
            finish_reason=reason,
            group_id=req.group_id,
            metadata=meta,
            num_interrupts=live.num_interrupts,
            top_logprobs=seq.top,
        )
