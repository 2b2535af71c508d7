"""Checks made before the first step, so that a user error is a one-line message naming the
key or file, not an ``IndexError`` in a forward pass after minutes of loading.

``check_run`` (``relayrl train | eval | filter``) runs before anything is written to the run
directory:

- ``algo.policy_loss`` names a registered loss (``relayrl.algos.registry``);
- every model directory the run loads (``model.path``, ``model.critic_path`` for PPO,
  ``reward.model_path``) exists and holds ``config.json`` and tokenizer files;
- ``env.factory`` names a builtin environment or a ``package.module:callable`` that imports,
  and ``env.agent.function`` a function that imports (``ConfigError`` naming the key);
- the policy tokenizer loads, has more than one token, and fits the embedding of the actor
  and of the critic (``vocab_size`` in their ``config.json``);
- a model whose ``prompt_format.json`` (written by ``relayrl sft``) names another prompt format
  than the run renders gets a warning on stderr;
- prompt + response fit every model's context (``max_position_embeddings`` / ``n_positions``
  / ... in its ``config.json``): ``rollout.max_tokens`` must leave room for a prompt, and when
  ``data.max_prompt_tokens + rollout.max_tokens`` is more than the context, the prompts the
  run would use are tokenised and none may be longer than ``context - rollout.max_tokens``
  (a configuration that only could overflow, with prompts that do not, is accepted: small
  models with the default ``data.max_prompt_tokens`` stay usable);
- ``rollout.max_model_len``, when set, is no more than the model's context and is the context
  the prompts are checked against;
- ``rollout.backend: vllm``: vLLM's KV cache (``rollout.vllm_kv_cache_gib``) holds one
  sequence of the served context (``rollout.max_model_len``, else the model's), which vLLM
  needs to start (``check_vllm_kv_cache``; the bytes: ``kv_cache_bytes``).

``check_sft_lengths`` is the SFT command's counterpart (prompt + response + EOS per example).

Errors are ``ConfigError`` (a key's value is wrong), ``ModelPathError`` (a model directory)
and ``DataError`` (a data file), which the CLI prints as one line with exit code 2.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from relayrl.algos import get_policy_loss
from relayrl.config import ConfigError, RunConfig
from relayrl.data import DataError
from relayrl.data.prompt_format import format_mismatch
from relayrl.model import (
    check_model_dir,
    check_tokenizer_files,
    check_vocab_fits,
    load_tokenizer,
    model_context_length,
    read_model_config,
)

__all__ = [
    "Context",
    "check_context",
    "check_env",
    "check_policy_loss",
    "check_run",
    "check_sft_lengths",
    "check_sft_val_prompts",
    "check_vllm_kv_cache",
    "kv_cache_bytes",
    "model_context",
]

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
VLLM_BLOCK = 16
"""Tokens per vLLM KV block: a sequence takes whole blocks (its default ``block_size``)."""


class Context:
    """The context length of one model, with where it was read from (for messages)."""

    def __init__(self, key: str, path: str | Path, tokens: int, config_key: str) -> None:
        self.key = key
        self.path = str(path)
        self.tokens = tokens
        self.config_key = config_key

    def describe(self) -> str:
        """``the 128-token context of model.path m/gpt2 (n_positions in its config.json)``;
        without ``config_key``: ``the 64-token context set by rollout.max_model_len``."""
        if not self.config_key:
            return f"the {self.tokens}-token context set by {self.key}"
        return (
            f"the {self.tokens}-token context of {self.key} {self.path} "
            f"({self.config_key} in its config.json)"
        )


def model_context(key: str, path: str | Path) -> Context | None:
    """The context of the model at ``path`` (named by config ``key``); None when its
    ``config.json`` names no context length (nothing to check against)."""
    found = model_context_length(path)
    return None if found is None else Context(key, path, found[0], found[1])


def _run_models(cfg: RunConfig, training: bool) -> list[tuple[str, str]]:
    """(config key, directory) of every model the run loads that reads the policy's ids."""
    models = [("model.path", cfg.model.path)]
    if training and cfg.algo.name == "ppo" and cfg.model.critic_path is not None:
        models.append(("model.critic_path", cfg.model.critic_path))
    return models


def check_run(cfg: RunConfig, training: bool = True, prompts: bool = True) -> None:
    """All start-up checks of an RL run (see the module docstring); ``training=False`` for
    ``relayrl eval`` / ``filter``, which load no critic; ``prompts=False`` reads none of the
    config's data files (``relayrl filter --input``, which checks its own prompts). Raises
    one-line errors."""
    check_policy_loss(cfg)
    models = _run_models(cfg, training)
    for _, path in models:
        check_model_dir(path)
    check_env(cfg)
    if cfg.reward.model_path is not None:
        check_tokenizer_files(cfg.reward.model_path)  # the reward model has its own tokenizer
    tokenizer = load_tokenizer(cfg.model.path)  # files, size, fits model.path's embedding
    src = cfg.data.source  # a model SFT'd in the other prompt format: a warning, not an error
    if note := format_mismatch(cfg.model.path, tokenizer, src.chat_template, src.system_prompt):
        print(note, file=sys.stderr)
    for key, path in models[1:]:
        check_vocab_fits(tokenizer, path, key)
    if cfg.algo.name == "dpo":  # offline: no generation, no rollout.max_tokens
        return
    contexts = [c for key, path in models if (c := model_context(key, path)) is not None]
    cap = cfg.rollout.max_model_len
    if cap is not None:
        for c in contexts:
            if cap > c.tokens:
                raise ConfigError(
                    f"rollout.max_model_len={cap} exceeds {c.describe()}: set "
                    f"rollout.max_model_len <= {c.tokens} (null: the model's own)"
                )
        contexts.append(Context("rollout.max_model_len", cfg.model.path, cap, ""))
    if cfg.rollout.backend == "vllm":
        served = cap or next((c.tokens for c in contexts if c.key == "model.path"), None)
        if served is not None:
            check_vllm_kv_cache(cfg, served)
    if contexts:
        check_context(cfg, tokenizer, min(contexts, key=lambda c: c.tokens), training, prompts)


def kv_cache_bytes(config: dict[str, Any], dtype: str, tokens: int) -> int | None:
    """KV cache bytes of one sequence of ``tokens`` tokens:
    ``2 x layers x kv_heads x head_dim x bytes(dtype) x tokens`` (2: a key and a value per
    layer, head and token; ``bytes(dtype)``: 4 for float32, 2 for bfloat16 / float16).
    ``config`` is the model's ``config.json``: ``num_hidden_layers`` (``n_layer``),
    ``num_key_value_heads`` (else ``num_attention_heads`` / ``n_head``: no GQA), ``head_dim``
    (else ``hidden_size`` / ``n_embd`` over the attention heads). None when a key is missing."""
    if "num_hidden_layers" not in config and isinstance(config.get("text_config"), dict):
        config = config["text_config"]  # a multimodal model: its language model's
    layers = config.get("num_hidden_layers", config.get("n_layer"))
    heads = config.get("num_attention_heads", config.get("n_head"))
    kv_heads = config.get("num_key_value_heads") or heads
    width = config.get("hidden_size", config.get("n_embd"))
    head_dim = config.get("head_dim") or (width // heads if width and heads else None)
    if not (layers and kv_heads and head_dim) or dtype not in DTYPE_BYTES:
        return None
    return 2 * int(layers) * int(kv_heads) * int(head_dim) * DTYPE_BYTES[dtype] * tokens


def check_vllm_kv_cache(cfg: RunConfig, tokens: int) -> None:
    """A one-line ``ConfigError`` when ``rollout.vllm_kv_cache_gib`` (GiB = 2**30 bytes)
    cannot hold one sequence of the served context, ``tokens`` rounded up to vLLM's
    ``VLLM_BLOCK``-token blocks (``kv_cache_bytes`` at ``model.dtype``, the KV dtype vLLM
    uses): vLLM would refuse to start, after loading the model, with a long error of its own.
    The message names the GiB needed and the ``rollout.max_model_len`` that fits (whole
    blocks)."""
    dtype = cfg.model.dtype
    padded = -(-tokens // VLLM_BLOCK) * VLLM_BLOCK
    need = kv_cache_bytes(read_model_config(cfg.model.path), dtype, padded)
    have = cfg.rollout.vllm_kv_cache_gib * (1 << 30)
    if need is None or need <= have:
        return
    fits = int(have // (need // padded)) // VLLM_BLOCK * VLLM_BLOCK
    gib = need / (1 << 30)
    gib = math.ceil(gib * 10 ** (d := 2 - math.floor(math.log10(gib)))) / 10**d  # 3 digits, up
    shorter = f" or rollout.max_model_len <= {fits}" if fits >= VLLM_BLOCK else ""
    raise ConfigError(
        f"rollout.vllm_kv_cache_gib={cfg.rollout.vllm_kv_cache_gib} cannot hold one "
        f"{tokens}-token sequence of model.path {cfg.model.path} ({dtype} KV needs {gib} GiB): "
        f"set rollout.vllm_kv_cache_gib >= {gib}{shorter}"
    )


def check_policy_loss(cfg: RunConfig) -> None:
    """``algo.policy_loss`` names a registered loss (``relayrl.algos.registry``), else a
    ``ConfigError`` listing the registered ones."""
    if cfg.algo.name == "dpo":  # DPO has its own loss
        return
    try:
        get_policy_loss(cfg.policy_loss)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def check_env(cfg: RunConfig) -> None:
    """``env.factory`` and ``env.agent.function`` resolve (the module imports and has the
    callable), else a ``ConfigError`` naming the key: found here, before the run directory is
    touched, instead of when the schedule is built after the models load."""
    if cfg.env.enabled:
        from relayrl.env.registry import resolve_factory

        try:
            resolve_factory(cfg.env.factory or "", cfg.env.kwargs)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    if cfg.env.agent.enabled:
        from relayrl.env.agent_rollout import load_agent  # fastapi, uvicorn: only then

        try:
            load_agent(cfg.env.agent.function or "")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None


def check_context(
    cfg: RunConfig, tokenizer: Any, ctx: Context, training: bool = True, prompts: bool = True
) -> None:
    """``rollout.max_tokens`` and the run's prompts against the smallest context ``ctx``
    (the training prompts only with ``training``; the eval set unless ``prompts`` is false)."""
    max_tokens = cfg.rollout.max_tokens
    max_prompt = cfg.data.max_prompt_tokens
    if max_tokens >= ctx.tokens:
        raise ConfigError(
            f"rollout.max_tokens={max_tokens} leaves no room for a prompt in {ctx.describe()}: "
            f"set rollout.max_tokens <= {ctx.tokens - 1} and data.max_prompt_tokens <= "
            f"{ctx.tokens} - rollout.max_tokens"
        )
    room = ctx.tokens - max_tokens
    if max_prompt <= room or not prompts:
        return
    from relayrl.data.prompts import PromptSource

    source = PromptSource(cfg.data, tokenizer, cfg.seed, with_train=training)
    for name, lengths in source.prompt_lengths(per_step=cfg.algo.prompts_per_step).items():
        over = [n for n in lengths if n > room]
        if over:
            raise ConfigError(
                f"data.max_prompt_tokens={max_prompt} + rollout.max_tokens={max_tokens} exceeds "
                f"{ctx.describe()}, and {len(over)} of {len(lengths)} prompts in {name} are "
                f"longer than {room} tokens (longest {max(over)}): set data.max_prompt_tokens "
                f"<= {room} (context - rollout.max_tokens) to skip them, or lower "
                "rollout.max_tokens"
            )


def check_sft_lengths(
    model_path: str | Path,
    lengths: Sequence[int],
    source: str,
    key: str = "model_path",
) -> None:
    """Raise a one-line ``DataError`` when an SFT example (prompt + response + EOS tokens,
    ``lengths``) is longer than the context of the model at ``model_path``."""
    ctx = model_context(key, model_path)
    if ctx is None or not lengths:
        return
    over = [n for n in lengths if n > ctx.tokens]
    if over:
        raise DataError(
            f"{len(over)} of {len(lengths)} SFT examples in {source} are longer than "
            f"{ctx.describe()} (longest {max(over)} tokens: prompt + response + EOS)"
        )


def check_sft_val_prompts(
    model_path: str | Path, lengths: Sequence[int], max_tokens: int, source: str
) -> None:
    """Raise a one-line ``DataError`` when a validation prompt leaves fewer than
    ``max_tokens`` tokens of the context for its greedy answer."""
    ctx = model_context("model_path", model_path)
    if ctx is None or not lengths:
        return
    room = ctx.tokens - max_tokens
    over = [n for n in lengths if n > room]
    if over:
        raise DataError(
            f"{len(over)} of {len(lengths)} validation prompts in {source} are longer than "
            f"{room} tokens, which leaves no room for a {max_tokens}-token answer in "
            f"{ctx.describe()} (longest {max(over)})"
        )
