"""Rollout: the generation engine behind ``submit`` / ``step`` / ``drain`` / ``update_weights``.

The built-in :class:`RolloutEngine` does continuous batching on any Hugging Face causal LM:
a scheduler (admission queue + slot table), a per-slot KV cache, a model runner (batched
prefill/decode forwards) and a sampler with per-request seeds. Every finished
:class:`Sample` carries per-token behaviour logprobs and the policy version of each token.
"""

from relayrl.rollout.engine import InvalidRequestError, RolloutEngine
from relayrl.rollout.types import (
    EngineReport,
    FinishReason,
    GenerationRequest,
    Sample,
    SamplingParams,
)

__all__ = [
    "EngineReport",
    "FinishReason",
    "GenerationRequest",
    "InvalidRequestError",
    "RolloutEngine",
    "Sample",
    "SamplingParams",
]
