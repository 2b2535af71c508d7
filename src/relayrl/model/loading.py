"""Load causal LMs, critics and tokenizers from a local Hugging Face directory (offline)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.utils import logging as hf_logging

from relayrl.model.atomic_dir import write_dir_atomic
from relayrl.model.known_models import KNOWN_MODELS, resolve_model_path

# Loading reports and shard progress bars are noise in an RL run's console.
hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()


class ModelPathError(ValueError):
    """A model directory is missing or is not a Hugging Face model directory."""


def check_model_dir(path: str | Path) -> Path:
    """Return ``path`` as a Path if it holds a Hugging Face model, else raise a one-line error
    (also for a weights file that cannot be read: see :func:`weights_problem`). A known model's
    short name (``smollm2``: ``relayrl.model.known_models``) is its fetched directory."""
    p = resolve_model_path(path)
    if not p.is_dir() and str(path) in KNOWN_MODELS:
        raise ModelPathError(
            f"model {str(path)!r} is not fetched yet (no {p}): run `relayrl models fetch {path}`"
        )
    if not p.is_dir():
        raise ModelPathError(f"model directory not found: {p}")
    if not (p / "config.json").is_file():
        raise ModelPathError(f"not a Hugging Face model directory (no config.json): {p}")
    problem = weights_problem(p)
    if problem is not None:
        raise ModelPathError(problem)
    return p


def weights_problem(path: str | Path) -> str | None:
    """What is wrong with the weights in ``path`` (a truncated or garbled safetensors file:
    its header and its length are checked, not every byte), or None. Cheap: headers only."""
    from safetensors import safe_open

    for f in sorted(Path(path).glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as handle:
                handle.keys()
        except Exception as exc:  # SafetensorError, OSError: the file cannot be used
            return f"{f}: the weights file is corrupt or truncated ({str(exc).splitlines()[0]})"
    return None


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
    "*.tiktoken",
)
"""The files a Hugging Face tokenizer is built from (one is enough). Without any of them
``AutoTokenizer`` silently builds an empty tokenizer of one token from the model class, and
every prompt then tokenises to nothing."""

CONTEXT_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "n_ctx",
    "seq_length",
    "max_sequence_length",
    "max_seq_len",
    "seq_len",
)
"""``config.json`` keys that give a model's context length, in the order they are tried."""


def read_model_config(path: str | Path) -> dict[str, Any]:
    """``config.json`` of a model directory as a dict (a one-line error when unreadable)."""
    p = check_model_dir(path)
    try:
        cfg = json.loads((p / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelPathError(f"{p / 'config.json'}: cannot read the model config: {e}") from e
    if not isinstance(cfg, dict):
        raise ModelPathError(f"{p / 'config.json'}: the model config is not a JSON object")
    return cfg


def _config_int(cfg: dict[str, Any], keys: tuple[str, ...]) -> tuple[int, str] | None:
    """The first positive integer among ``keys``, at the top level or in a nested
    ``text_config`` (multimodal models), with the key it came from."""
    for section in (cfg, cfg.get("text_config")):
        if not isinstance(section, dict):
            continue
        for key in keys:
            value = section.get(key)
            if type(value) is int and value > 0:
                return value, key
    return None


def model_context_length(path: str | Path) -> tuple[int, str] | None:
    """(context length in tokens, the ``config.json`` key it was read from), or None when the
    config names none of ``CONTEXT_KEYS``."""
    return _config_int(read_model_config(path), CONTEXT_KEYS)


def model_vocab_size(path: str | Path) -> int | None:
    """Rows of the model's input embedding (``vocab_size`` in ``config.json``), if given."""
    found = _config_int(read_model_config(path), ("vocab_size", "n_vocab", "padded_vocab_size"))
    return found[0] if found is not None else None


def check_tokenizer_files(path: str | Path) -> Path:
    """Raise a one-line ``ModelPathError`` when ``path`` holds none of ``TOKENIZER_FILES``."""
    p = check_model_dir(path)
    if not any(any(p.glob(name)) for name in TOKENIZER_FILES):
        raise ModelPathError(
            f"{p}: the tokenizer files are missing (looked for {', '.join(TOKENIZER_FILES)}); "
            "save the model's tokenizer there with tokenizer.save_pretrained()"
        )
    return p


def check_vocab_fits(tokenizer: Any, path: str | Path, what: str = "the model") -> None:
    """Raise a one-line ``ModelPathError`` when the tokenizer can produce ids that the
    embedding of the model at ``path`` has no row for (an ``IndexError`` deep in a forward)."""
    rows = model_vocab_size(path)
    n = len(tokenizer)
    if rows is not None and n > rows:
        raise ModelPathError(
            f"{path}: the tokenizer has {n} tokens but {what}'s embedding has {rows} rows "
            f"(vocab_size in config.json): token ids {rows}..{n - 1} would be out of range"
        )


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Load the tokenizer saved next to a model; pad token falls back to eos.

    Checked on the way (a one-line ``ModelPathError``): the directory holds tokenizer files,
    the tokenizer has more than one token, and none of its ids is beyond the model's
    embedding (``vocab_size`` in the same directory's ``config.json``).
    """
    p = check_tokenizer_files(path)
    tok = AutoTokenizer.from_pretrained(p, local_files_only=True)
    if len(tok) < 2:
        raise ModelPathError(
            f"{p}: the tokenizer has {len(tok)} token(s); its files are empty or broken"
        )
    check_vocab_fits(tok, p)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


FUNCTIONAL_DROPOUT_ATTRS = ("attention_dropout",)
"""Float attributes of Hugging Face modules that are a dropout probability applied in train
mode without a dropout module (Llama / Qwen2 / Mistral attention: ``config.attention_dropout``)."""


_M = TypeVar("_M", bound=torch.nn.Module)


def disable_dropout(model: _M) -> _M:
    """Set every dropout probability to 0 (as TRL and veRL do for RL): the logprobs of a
    training forward must equal the rollout's, and runs must be reproducible from the seed.
    Covers ``nn.Dropout`` modules and the attention dropout applied functionally
    (``FUNCTIONAL_DROPOUT_ATTRS``)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for attr in FUNCTIONAL_DROPOUT_ATTRS:
            if isinstance(module.__dict__.get(attr), float):
                setattr(module, attr, 0.0)
    return model


def has_train_dropout(model: torch.nn.Module) -> bool:
    """Whether a train-mode forward of ``model`` differs from its eval-mode forward by dropout:
    a dropout module (``nn.Dropout`` and its kinds, e.g. LoRA's ``lora_dropout``) with p > 0,
    or a functional attention dropout > 0 (``FUNCTIONAL_DROPOUT_ATTRS``). Without it the two
    forwards compute the same logprobs (what the actor's single-update shortcut relies on)."""
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            return True
        for attr in FUNCTIONAL_DROPOUT_ATTRS:
            value = module.__dict__.get(attr)
            if isinstance(value, float) and value > 0:
                return True
    return False


def load_causal_lm(path: str | Path, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """Load a causal LM through ``AutoModelForCausalLM`` from a local directory, offline,
    with dropout disabled."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    p = check_model_dir(path)
    model = AutoModelForCausalLM.from_pretrained(p, dtype=dtype, local_files_only=True)
    return disable_dropout(model)


def load_critic(path: str | Path, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """A critic: the LM backbone plus a scalar value head per token.

    Uses ``AutoModelForTokenClassification`` with one label, so a critic is saved and loaded in
    plain Hugging Face format. Built from an actor directory, the value head starts at zero
    (V = 0 everywhere), which keeps the first GAE step equal to a plain return-to-go. Built
    from a reward model (``relayrl rm``'s output, ``*ForSequenceClassification``; InstructGPT
    initialises its value function from the reward model) it keeps the reward model's scalar
    head, rescaled to the score PPO gets from it by default (``reward.model_normalize``):
    V(s) = (w . h(s) - mean) / std, i.e. head weight w / std and bias -mean / std, with the
    ``reward_mean`` / ``reward_std`` of its ``relayrl_rm.json`` (mean 0, std 1 without it).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    p = check_model_dir(path)
    model = AutoModelForTokenClassification.from_pretrained(
        p, num_labels=1, dtype=dtype, local_files_only=True
    )
    disable_dropout(model)
    head = _value_head(model)
    kind = _head_kind(p)
    if kind == "critic":
        return model
    with torch.no_grad():
        bias = getattr(head, "bias", None)
        if kind == "reward_model":
            mean, std = _reward_stats(p)
            head.weight.div_(std)
            if bias is not None:
                bias.fill_(-mean / std)
        else:
            head.weight.zero_()
            if bias is not None:
                bias.zero_()
    return model


def _value_head(model: PreTrainedModel) -> torch.nn.Linear:
    for name in ("score", "classifier"):
        head = getattr(model, name, None)
        if isinstance(head, torch.nn.Linear):
            return head
    raise TypeError(f"cannot find the value head of {type(model).__name__}")


def _head_kind(path: Path) -> str:
    """``critic`` (a saved critic), ``reward_model`` (a scalar reward model) or ``new``."""
    cfg = json.loads((path / "config.json").read_text())
    arch = cfg.get("architectures") or []
    if any(a.endswith("ForTokenClassification") for a in arch):
        return "critic"
    labels = cfg.get("num_labels", len(cfg.get("id2label") or {}) or 2)
    if any(a.endswith("ForSequenceClassification") for a in arch) and labels == 1:
        return "reward_model"
    return "new"


def _reward_stats(path: Path) -> tuple[float, float]:
    """A reward model's (reward_mean, reward_std) from its ``relayrl_rm.json`` (0, 1 without)."""
    stats_file = path / "relayrl_rm.json"
    stats = json.loads(stats_file.read_text()) if stats_file.is_file() else {}
    mean = float(stats.get("reward_mean", 0.0))
    std = float(stats.get("reward_std", 1.0))
    return mean, std if math.isfinite(std) and std > 1e-6 else 1.0


def save_model_atomic(
    model: Any,
    tokenizer: Any,
    out_dir: str | Path,
    extra_files: Mapping[str, str] | None = None,
    keep: tuple[str, ...] = (),
    fill_more: Callable[[Path], None] | None = None,
) -> Path:
    """``save_pretrained`` (model, tokenizer and ``extra_files`` name -> text) written as one
    directory with :func:`relayrl.model.atomic_dir.write_dir_atomic`: a reader sees the old
    directory or the new one; ``keep``: entries of the old one carried into the new one
    (``relayrl sft``'s ``checkpoints``); ``fill_more(tmp)``: writes more files into the new
    directory before the swap (``relayrl rm``'s ``metrics.jsonl``: in place with the model or
    not at all); a process killed in the swap leaves what :func:`finish_interrupted_save`
    completes; a failed write leaves ``out_dir`` as it was."""

    def fill(tmp: Path) -> None:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        if fill_more is not None:
            fill_more(tmp)

    return write_dir_atomic(out_dir, fill, keep)
