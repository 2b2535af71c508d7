"""Models: load any local Hugging Face causal LM, critics, per-token logprobs, tiny builder."""

from relayrl.model.atomic_dir import finish_interrupted_save, write_dir_atomic
from relayrl.model.batching import TokenBatch, forward_logprobs, forward_values, pack_batch
from relayrl.model.loading import (
    CONTEXT_KEYS,
    TOKENIZER_FILES,
    ModelPathError,
    check_model_dir,
    check_tokenizer_files,
    check_vocab_fits,
    load_causal_lm,
    load_critic,
    load_tokenizer,
    model_context_length,
    model_vocab_size,
    read_model_config,
    save_model_atomic,
    weights_problem,
)
from relayrl.model.threads import resolve_threads, set_threads
from relayrl.model.tiny import build_char_tokenizer, build_tiny_model

__all__ = [
    "CONTEXT_KEYS",
    "TOKENIZER_FILES",
    "ModelPathError",
    "TokenBatch",
    "build_char_tokenizer",
    "build_tiny_model",
    "check_model_dir",
    "check_tokenizer_files",
    "check_vocab_fits",
    "forward_logprobs",
    "forward_values",
    "load_causal_lm",
    "load_critic",
    "load_tokenizer",
    "model_context_length",
    "model_vocab_size",
    "pack_batch",
    "read_model_config",
    "resolve_threads",
    "finish_interrupted_save",
    "save_model_atomic",
    "set_threads",
    "weights_problem",
    "write_dir_atomic",
]
