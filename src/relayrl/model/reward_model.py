"""The scalar reward head: load a reward model, encode its inputs, score texts (raw r(x, y)).

The reward model is an LM backbone plus a scalar head read at the last non-pad token:
Hugging Face ``AutoModelForSequenceClassification`` with ``num_labels=1``, so the saved
directory loads as is with ``from_pretrained``. Its input is ``prompt`` and ``completion``
tokenised separately and concatenated (the policy's token-in layout), right-padded.

Next to the weights, ``relayrl_rm.json`` (``RM_STATS_FILE``) records the held-out figures and
the mean and std of the reward over the training completions; the scorer
(``relayrl.reward.service.rm_scorer.RewardModelScorer``) uses them to normalise scores to mean
0, std 1 on the data the model was trained on (InstructGPT normalises its RM so that reference
completions score 0 on average). Training is
``relayrl.controller.rm_training`` (``relayrl rm``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from transformers import AutoModelForSequenceClassification, PreTrainedModel

from relayrl.model.loading import check_model_dir

__all__ = [
    "DTYPES",
    "RM_STATS_FILE",
    "EncodedBatch",
    "encode",
    "load_reward_model",
    "reward_forward",
    "score_texts",
]

RM_STATS_FILE = "relayrl_rm.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


@dataclass
class EncodedBatch:
    """Right-padded ``prompt + completion`` token ids."""

    input_ids: Tensor  # [B, L]
    attention_mask: Tensor  # [B, L]
    truncated: int  # rows cut to max_length


def encode(
    tokenizer: Any,
    prompts: Sequence[str],
    completions: Sequence[str],
    max_length: int = 512,
) -> EncodedBatch:
    """ids = tok(prompt) + tok(completion, no special tokens), keeping the last
    ``max_length`` ids; right-padded with the pad id. An empty input becomes one EOS."""
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    rows: list[list[int]] = []
    truncated = 0
    filler = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    for prompt, completion in zip(prompts, completions, strict=True):
        ids = list(tokenizer(prompt).input_ids) if prompt else []
        if completion:
            ids += list(tokenizer(completion, add_special_tokens=False).input_ids)
        if len(ids) > max_length:
            ids = ids[-max_length:]
            truncated += 1
        rows.append(ids or [filler])
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        input_ids[i, : len(r)] = torch.as_tensor(r, dtype=torch.long)
        mask[i, : len(r)] = 1
    return EncodedBatch(input_ids, mask, truncated)


def reward_forward(model: torch.nn.Module, batch: EncodedBatch) -> Tensor:
    """r(x, y) [B] in fp32: the scalar head at each row's last non-pad token."""
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    return out.logits[:, 0].float()


@torch.no_grad()
def score_texts(
    model: torch.nn.Module,
    tokenizer: Any,
    prompts: Sequence[str],
    completions: Sequence[str],
    batch_size: int = 64,
    max_length: int = 512,
) -> Tensor:
    """Raw rewards r(x, y) [N] in batches of ``batch_size`` (model put in eval mode)."""
    was_training = model.training
    model.eval()
    out = []
    for s in range(0, len(prompts), batch_size):
        batch = encode(
            tokenizer, prompts[s : s + batch_size], completions[s : s + batch_size], max_length
        )
        out.append(reward_forward(model, batch))
    model.train(was_training)
    return torch.cat(out) if out else torch.zeros(0)


def load_reward_model(
    path: str | Path, dtype: torch.dtype = torch.float32, pad_token_id: int | None = None
) -> PreTrainedModel:
    """``AutoModelForSequenceClassification`` with one label from a local directory.

    From a causal-LM directory the head is new and zero-initialised (r = 0 everywhere).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    p = check_model_dir(path)
    model = AutoModelForSequenceClassification.from_pretrained(
        p, num_labels=1, dtype=dtype, local_files_only=True
    )
    if pad_token_id is not None:
        model.config.pad_token_id = pad_token_id
    cfg = json.loads((p / "config.json").read_text())
    trained = any(a.endswith("ForSequenceClassification") for a in cfg.get("architectures") or [])
    if not trained:
        head = getattr(model, "score", None) or getattr(model, "classifier", None)
        if isinstance(head, torch.nn.Linear):
            with torch.no_grad():
                head.weight.zero_()
                if head.bias is not None:
                    head.bias.zero_()
    return model
