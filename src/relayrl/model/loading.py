"""Load causal LMs, critics and tokenizers from a local Hugging Face directory (offline)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.utils import logging as hf_logging

# Loading reports and shard progress bars are noise in an RL run's console.
hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()


class ModelPathError(ValueError):
    """A model directory is missing or is not a Hugging Face model directory."""


def check_model_dir(path: str | Path) -> Path:
    """Return ``path`` as a Path if it holds a Hugging Face model, else raise a one-line error."""
    p = Path(path)
    if not p.is_dir():
        raise ModelPathError(f"model directory not found: {p}")
    if not (p / "config.json").is_file():
        raise ModelPathError(f"not a Hugging Face model directory (no config.json): {p}")
    return p


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Load the tokenizer saved next to a model; pad token falls back to eos."""
    p = check_model_dir(path)
    tok = AutoTokenizer.from_pretrained(p, local_files_only=True)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def disable_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """Set every dropout probability to 0 (as TRL and veRL do for RL): the logprobs of a
    training forward must equal the rollout's, and runs must be reproducible from the seed."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


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
    (V = 0 everywhere), which keeps the first GAE step equal to a plain return-to-go.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    p = check_model_dir(path)
    model = AutoModelForTokenClassification.from_pretrained(
        p, num_labels=1, dtype=dtype, local_files_only=True
    )
    disable_dropout(model)
    head = _value_head(model)
    if not _is_trained_critic(p):
        with torch.no_grad():
            head.weight.zero_()
            if getattr(head, "bias", None) is not None:
                head.bias.zero_()
    return model


def _value_head(model: PreTrainedModel) -> torch.nn.Linear:
    for name in ("score", "classifier"):
        head = getattr(model, name, None)
        if isinstance(head, torch.nn.Linear):
            return head
    raise TypeError(f"cannot find the value head of {type(model).__name__}")


def _is_trained_critic(path: Path) -> bool:
    import json

    cfg = json.loads((path / "config.json").read_text())
    return any(a.endswith("ForTokenClassification") for a in cfg.get("architectures") or [])


def save_model_atomic(
    model: Any, tokenizer: Any, out_dir: str | Path, extra_files: Mapping[str, str] | None = None
) -> Path:
    """``save_pretrained`` (model, tokenizer and ``extra_files`` name -> text) into a temp dir
    next to ``out_dir``, then swap it in: a reader sees the old directory or the new one."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp_{out.name}_{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    for name, text in (extra_files or {}).items():
        (tmp / name).write_text(text)
    if out.exists():
        old = out.parent / f".old_{out.name}_{os.getpid()}"
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)
    return out
