"""Each 2025 policy loss trains the tiny model: GRPO with it raises the held-out pass rate
(60 steps from the SFT fixture, the settings of ``test_train_integration``). GSPO runs in the
default suite; the others are ``slow`` (about a minute each on 2 cores)."""

from __future__ import annotations

import pytest

from helpers import run_config
from relayrl.cluster.local import build_local_roles
from relayrl.controller.trainer import train

GAINS = {
    "gspo": "GSPO_DOC",
}


def _gain(sft_model, tmp_path, outcome, *overrides: str) -> dict:
    cfg = run_config(sft_model, tmp_path, "train.steps=60", "data.eval_size=200", *overrides)
    out = train(cfg, lambda a, c: build_local_roles(cfg, a, c))
    outcome(before=out["eval_before"], after=out["eval_after"])
    return out
