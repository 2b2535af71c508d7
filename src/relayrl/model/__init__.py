"""Models: load any local Hugging Face causal LM, critics, per-token logprobs, tiny builder."""

from relayrl.model.batching import TokenBatch, forward_logprobs, forward_values, pack_batch
from relayrl.model.loading import (
    ModelPathError,
    check_model_dir,
    load_causal_lm,
    load_critic,
    load_tokenizer,
    save_model_atomic,
)
from relayrl.model.threads import resolve_threads, set_threads
from relayrl.model.tiny import build_char_tokenizer, build_tiny_model

__all__ = [
    "ModelPathError",
    "TokenBatch",
    "build_char_tokenizer",
    "build_tiny_model",
    "check_model_dir",
    "forward_logprobs",
    "forward_values",
    "load_causal_lm",
    "load_critic",
    "load_tokenizer",
    "pack_batch",
    "resolve_threads",
    "save_model_atomic",
    "set_threads",
]
