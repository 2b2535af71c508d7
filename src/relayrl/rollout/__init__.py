"""Rollout: the generation engine behind ``submit`` / ``step`` / ``drain`` / ``update_weights``.

The built-in :class:`RolloutEngine` does continuous batching on any Hugging Face causal LM:
a scheduler (admission queue + slot table), a per-slot KV cache, a model runner (batched
prefill/decode forwards) and a sampler with per-request seeds. Every finished
:class:`Sample` carries per-token behaviour logprobs and the policy version of each token.

Every backend in the rollout slot (the own engine, vLLM, the engine-process and Ray clients,
the episode and agent runners) implements :class:`RolloutBackend` (``relayrl.rollout.backend``):
a :class:`SteppingEngine` (``submit`` / ``step``) or a :class:`PollingBackend` (``submit_many``
/ ``poll``).
"""

from relayrl.rollout.backend import (
    EpisodeMetrics,
    LivePollingBackend,
    PollingBackend,
    RolloutBackend,
    SteppingEngine,
    driven,
)
from relayrl.rollout.engine import InvalidRequestError, RolloutEngine
from relayrl.rollout.types import (
    EngineReport,
    FinishReason,
    GenerationRequest,
    Sample,
    SamplingParams,
    error_sample,
)

__all__ = [
    "EngineReport",
    "EpisodeMetrics",
    "FinishReason",
    "GenerationRequest",
    "InvalidRequestError",
    "LivePollingBackend",
    "PollingBackend",
    "RolloutBackend",
    "RolloutEngine",
    "Sample",
    "SamplingParams",
    "SteppingEngine",
    "driven",
    "error_sample",
]
