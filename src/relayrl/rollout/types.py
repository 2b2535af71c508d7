"""The rollout interface's data types: token in, token out.

A request carries prompt token ids (tokenised once by the client); a finished sample carries,
per response token, the sampled id, its logprob under the exact distribution it was sampled
from (the behaviour policy) and the policy version the engine stamped on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

FinishReason = Literal["eos", "length", "stop", "abort"]


@dataclass
class SamplingParams:
    """How to sample one request.

    temperature == 0 or greedy=True means argmax (logprobs are then reported under the
    temperature-1 distribution). top_k = 0 and top_p = 1.0 disable those filters.
    ``ignore_eos`` keeps generating past the EOS token (only ``max_tokens`` / stop ids end the
    request); benchmarks use it to emulate target lengths. ``top_logprobs`` = k > 0 keeps, per
    response token, the k most likely tokens of its distribution (``Sample.top_logprobs``;
    every engine: the built-in one, its worker process, vLLM: :mod:`relayrl.rollout.top_logprobs`).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False
    max_tokens: int = 64
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False
    top_logprobs: int = 0


@dataclass
class GenerationRequest:
    """One prompt to complete. ``group_id`` ties the G samples of a GRPO group together."""

    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    group_id: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class Sample:
    """A finished generation.

    ``loss_mask`` (multi-turn episodes, ``relayrl.env``): per response token, 1 where the model
    produced it (trained), 0 where an environment did (observation / tool tokens: attended to,
    never trained); None means all ones. Behaviour logprobs and versions of 0-mask tokens are
    placeholders (0.0 and the version of the model token before them).
    """

    request_id: int
    prompt_ids: list[int]
    response_ids: list[int]
    behaviour_logprobs: list[float]
    versions: list[int]
    finish_reason: FinishReason
    group_id: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    num_interrupts: int = 0
    error: str | None = None
    loss_mask: list[int] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per token (when asked)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


def error_sample(request_id: int, request: GenerationRequest, error: str) -> Sample:
    """The ``'abort'`` sample, no tokens and ``error`` set, a backend hands back in place of
    a request it cannot run (``generate``), and the async rollout controller makes of a
    request a polling backend refused (``rejected()``): an infrastructure failure
    (``controller.failures``: ``engine``)."""
    return Sample(
        request_id=request_id,
        prompt_ids=list(request.prompt_ids),
        response_ids=[],
        behaviour_logprobs=[],
        versions=[],
        finish_reason="abort",
        group_id=request.group_id,
        metadata=request.metadata,
        error=error,
    )


@dataclass
class EngineReport:
    """What every rollout backend reports (``report()``): the same shape in and out of process.

    ``counters`` are the engine's counters since it started (``RolloutEngine.stats()``; merged
    over replicas by a pool); ``busy_spans`` are the (start, end) ``perf_counter`` seconds the
    engine spent generating since the previous report. An engine in the caller's process
    reports no spans: its caller's own clock is the engine's.
    """

    counters: dict[str, Any]
    busy_spans: list[tuple[float, float]] = field(default_factory=list)
