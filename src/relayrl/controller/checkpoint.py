"""Atomic checkpoints in Hugging Face format.

Layout: ``run_dir/checkpoints/step_000010/{actor,critic}/`` (``save_pretrained`` + tokenizer,
so ``AutoModelForCausalLM.from_pretrained(.../actor)`` loads as is) and ``trainer_state.pt``
(optimizer, scheduler, shuffling generators, KL controller, step, RNG states).
A checkpoint is written into a temporary directory and renamed into place in one step, and
``latest`` is replaced atomically afterwards: an interrupted save never damages what is there.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

STATE_FILE = "trainer_state.pt"


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def rng_state() -> dict[str, Any]:
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }


def seed_everything(seed: int) -> None:
    """Seed torch, Python and numpy global RNGs from the run config."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    models: dict[str, Any],
    tokenizer: Any,
    trainer_state: dict[str, Any],
    keep: int = 2,
) -> Path:
    """Write ``models`` (name -> HF model) and ``trainer_state`` for ``step`` atomically."""
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp_step_{step:06d}_{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    for name, model in models.items():
        model.save_pretrained(tmp / name)
        tokenizer.save_pretrained(tmp / name)
    torch.save({**trainer_state, "step": step, "rng": rng_state()}, tmp / STATE_FILE)
    _fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    latest_tmp = root / f".latest_{os.getpid()}"
    latest_tmp.write_text(final.name + "\n")
    os.replace(latest_tmp, root / "latest")
    _prune(root, keep)
    return final


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint, or None."""
    root = checkpoint_root(run_dir)
    marker = root / "latest"
    if marker.is_file():
        cand = root / marker.read_text().strip()
        if (cand / STATE_FILE).is_file():
            return cand
    done = sorted(p for p in root.glob("step_*") if (p / STATE_FILE).is_file())
    return done[-1] if done else None


def load_trainer_state(ckpt: Path) -> dict[str, Any]:
    return torch.load(ckpt / STATE_FILE, weights_only=False)


def _prune(root: Path, keep: int) -> None:
    """Keep the ``keep`` most recently written checkpoints (by write time, not step number:
    a fresh run in an old run directory must never delete what it just wrote)."""
    done = sorted(
        (p for p in root.glob("step_*") if (p / STATE_FILE).is_file()),
        key=lambda p: (p / STATE_FILE).stat().st_mtime_ns,
    )
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    for f in path.rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
