"""The teacher of on-policy distillation: a frozen model that scores the student's samples.

It is a :class:`~relayrl.workers.actor.ReferenceWorker` loaded from its own directory; the
student's token ids are fed to it as they are, so both must share one tokenizer (checked).
"""

from __future__ import annotations

from pathlib import Path

import torch

from relayrl.config import RunConfig
from relayrl.model import load_causal_lm, load_tokenizer
from relayrl.workers.actor import ReferenceWorker

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def load_teacher(cfg: RunConfig) -> ReferenceWorker:
    """The teacher of ``algo.distill.teacher_path``, at the run's dtype, micro-batching and
    sampling temperature; ValueError naming the directory if it is missing or its tokenizer
    differs from the student's (``model.path``)."""
    path = cfg.algo.distill.teacher_path
    if path is None or not (Path(path) / "config.json").is_file():
        raise ValueError(f"algo.distill.teacher_path: model directory not found: {path}")
    teacher_vocab = load_tokenizer(path).get_vocab()
    if teacher_vocab != load_tokenizer(cfg.model.path).get_vocab():
        raise ValueError(
            f"algo.distill.teacher_path: {path} has another tokenizer than the student "
            f"({cfg.model.path}); distillation scores the student's token ids as they are"
        )
    return ReferenceWorker.from_config(load_causal_lm(path, DTYPES[cfg.model.dtype]), cfg)
