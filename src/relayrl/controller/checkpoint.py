"""Atomic checkpoints in Hugging Face format.

Layout: ``run_dir/checkpoints/step_000010/{actor,critic}/`` (``save_pretrained`` + tokenizer,
so ``AutoModelForCausalLM.from_pretrained(.../actor)`` loads as is) and ``trainer_state.pt``
(optimizer, scheduler, shuffling generators, KL controller, step, RNG states).
An FSDP2 role (``sharded`` True) keeps its parameters and optimizer state in
``sharded_<role>/`` instead (``torch.distributed.checkpoint``, written by every rank: see
:func:`role_state`), and ``trainer_state.pt`` names that folder; ``<role>/`` stays the full
HF export gathered bucket by bucket, loadable with plain ``from_pretrained``.
A checkpoint is written into a temporary directory and renamed into place in one step, and
``latest`` is replaced atomically afterwards: an interrupted save never damages what is there.
Both survive a power loss too, not only a killed process (``relayrl.model.atomic_dir``'s
helpers): the checkpoint's files and directories are fsynced before its rename, ``checkpoints/``
after it; ``latest`` is fsynced before its rename, ``checkpoints/`` again after it. So the
checkpoint ``latest`` names is on disk before ``latest`` is. The run's appended logs
(``metrics.jsonl``, ``trajectories.jsonl``: flushed as written, not fsynced) are fsynced before
the checkpoint's rename, so the records up to a checkpoint on disk are on disk too.
A checkpoint is removed (pruned to the ``keep`` newest, or replaced by a save of the same step)
by first renaming it to a hidden ``.pruned_<name>``, which nothing lists or resumes from (they
look for ``step_*``), fsyncing ``checkpoints/``, and only then deleting it: a removed checkpoint
never reappears after a power loss, nor half-deleted after a kill. The hidden leftovers of an
interrupted removal go with the next save's pruning or the next claim of the run directory.
A save that fails removes its temporary directory; one that fails writing (an ``OSError``: disk
full, read-only, I/O error; or the same fault as torch's zip writer or safetensors report it,
e.g. ``unexpected pos 460032 vs 459920``) raises :class:`CheckpointWriteError` naming the
step, the cause (``No space left on device`` when the disk is full) and the newest intact
checkpoint (the one just written when only ``latest`` failed: see :func:`latest_checkpoint`).
Temporary folders left by a killed process are removed when the next run claims the directory
(:func:`remove_partial_writes`).
"""

from __future__ import annotations

import errno
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from relayrl.controller.faults import CheckpointWriteError
from relayrl.durable import (
    fsync_dir,
    fsync_file,
    fsync_tree,
    mkdir_durable,
    replace_durable,
    write_file_durable,
)
from relayrl.model import weights_problem
from relayrl.model.lora import save_merged
from relayrl.telemetry.metrics import METRICS_FILE

STATE_FILE = "trainer_state.pt"
SHARDED_KEY = "sharded_dir"
"""In a role's entry of ``trainer_state.pt``: the folder of its sharded checkpoint."""
SHARDED_PREFIX = "sharded_"
"""The folder of a role's sharded checkpoint is ``sharded_<role>``."""

Writer = Callable[[Path], None]
MERGED_DIR = "actor_merged"
"""With ``model.lora.save_merged``: base + merged adapters, a plain HF directory."""
PRUNED_PREFIX = ".pruned_"
"""A checkpoint being removed: renamed to ``.pruned_<name>`` (no ``step_*``) before deletion."""
RUN_LOGS = (METRICS_FILE, "trajectories.jsonl")
"""The run's appended logs, fsynced with each checkpoint (the second is ``relayrl.env.export``'s
``FILE``, named here so that a checkpoint does not import the rollout engine with it)."""


def merged_export(model: Any, tokenizer: Any) -> Writer:
    """A writer of ``MERGED_DIR``: the LoRA actor's adapters merged into a copy of its base."""

    def write(ckpt: Path) -> None:
        save_merged(model, tokenizer, ckpt / MERGED_DIR)

    return write


"""Writes part of a checkpoint into the (temporary) checkpoint directory it is given."""


def role_state(role: Any, name: str) -> tuple[dict[str, Any], Writer | None]:
    """What ``trainer_state.pt`` holds for a trainable role, and the writer of its sharded
    checkpoint (None for a replicated role, whose optimizer state is in the entry itself)."""
    if not getattr(role, "sharded", False):
        return role.train_state(), None
    sub = f"{SHARDED_PREFIX}{name}"

    def write(ckpt_dir: Path) -> None:
        role.save_sharded(str(ckpt_dir / sub))

    return {SHARDED_KEY: sub}, write


def load_role_state(role: Any, entry: dict[str, Any], ckpt: Path) -> None:
    """Restore a role from its ``trainer_state.pt`` entry (and its sharded checkpoint)."""
    if SHARDED_KEY in entry:
        if not getattr(role, "sharded", False):
            raise ValueError(
                f"{ckpt}: {entry[SHARDED_KEY]} is a sharded (FSDP2) checkpoint; resume it with "
                "model.fsdp.enabled=true on the same number of ranks"
            )
        role.load_sharded(str(ckpt / entry[SHARDED_KEY]))
    else:
        if getattr(role, "sharded", False):
            raise ValueError(
                f"{ckpt}: the checkpoint is not sharded; resume it with model.fsdp.enabled=false"
            )
        role.load_train_state(entry)


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
    rng: dict[str, Any] | None = None,
    writers: list[Writer] | None = None,
) -> Path:
    """Write ``models`` (name -> HF model) and ``trainer_state`` for ``step`` atomically.

    ``writers`` write the sharded parts into the temporary directory before it is renamed.
    ``rng``: the RNG states to store (default: the current ones); the trainer passes those of
    the step boundary, which a checkpoint written on a signal was taken after.
    Raises :class:`CheckpointWriteError` on an ``OSError``; on any failure (an interrupt too)
    the temporary directory is removed and the checkpoints already there are untouched.
    """
    root = checkpoint_root(run_dir)
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp_step_{step:06d}_{os.getpid()}"
    placed = False  # the checkpoint renamed into place: complete, whatever fails after
    try:
        mkdir_durable(root)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        for name, model in models.items():
            model.save_pretrained(tmp / name)
            tokenizer.save_pretrained(tmp / name)
        for write in writers or []:
            write(tmp)
        state = {**trainer_state, "step": step, "rng": rng if rng is not None else rng_state()}
        torch.save(state, tmp / STATE_FILE)
        fsync_tree(tmp)
        for log in (Path(run_dir) / name for name in RUN_LOGS):
            if log.is_file():
                fsync_file(log)
        replaced = _set_aside(root, final) if final.exists() else None
        replace_durable(tmp, final)  # with the setting aside: one fsync of checkpoints/
        placed = True
        write_file_durable(root / "latest", final.name + "\n")
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)
    except BaseException as exc:
        reason = write_failure(exc, root)  # before the cleanup frees space
        shutil.rmtree(tmp, ignore_errors=True)  # latest's temporary: write_file_durable's
        if reason is not None:
            what = (
                f"is written but {root / 'latest'} could not be updated"
                if placed
                else "could not be written"
            )
            raise CheckpointWriteError(
                f"checkpoint {final.name} {what} ({reason}); {newest_intact(run_dir)}"
            ) from exc
        raise
    _prune(root, keep)
    return final


WRITE_FAULT_MARKS = (
    "unexpected pos",  # torch's zip writer, after a short write
    "file write failed",
    "iostream error",
    "I/O error",  # safetensors: "Error while serializing: I/O error: ..."
    "os error",
)
"""How torch and safetensors word an I/O failure they do not raise as an ``OSError``."""
FULL_DISK_BYTES = 1 << 20
"""Free space under which a write failure without an errno is taken for a full disk."""


def free_bytes(path: Path) -> int:
    """Free bytes on the filesystem of ``path`` (of its nearest existing parent)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return FULL_DISK_BYTES


def write_failure(exc: BaseException, where: Path) -> str | None:
    """The cause of a failed write, in words (``No space left on device`` for a full disk), or
    None when ``exc`` is no I/O failure. Torch's zip writer and safetensors report ENOSPC as a
    RuntimeError / SafetensorError without an errno: their wording marks them, and the free
    space under ``where`` tells a full disk from another fault. A Ray task's error (a sharded
    role's ranks write in Ray workers) is judged by the worker's exception (its ``cause``), not
    by its text, the worker's whole traceback."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        exc = cause
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    if not isinstance(exc, Exception):
        return None
    text = " ".join(str(e) for e in (exc, exc.__context__, exc.__cause__) if e is not None)
    if "No space left" in text or "os error 28" in text:
        return os.strerror(errno.ENOSPC)
    if not any(mark in text for mark in WRITE_FAULT_MARKS):
        return None
    if free_bytes(where) < FULL_DISK_BYTES:
        return os.strerror(errno.ENOSPC)
    return f"write failed: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"


def newest_intact(run_dir: str | Path) -> str:
    """``the newest intact checkpoint is <path>`` or ``no checkpoint was written``: the end of
    every fault message."""
    ckpt = latest_checkpoint(run_dir)
    return f"the newest intact checkpoint is {ckpt}" if ckpt else "no checkpoint was written"


def remove_partial_writes(run_dir: str | Path) -> list[Path]:
    """Remove what interrupted saves left in ``checkpoints/`` (``.tmp_step_*`` folders,
    ``.latest_*`` markers, ``.pruned_*`` checkpoints of an interrupted removal); return their
    paths. Only for the holder of the run lock: then no other process can be writing them."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    removed = []
    leftovers = [".tmp_step_*", ".latest_*", f"{PRUNED_PREFIX}*"]
    for p in sorted(q for pattern in leftovers for q in root.glob(pattern)):
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()
        removed.append(p)
    return removed


def checkpoint_step(ckpt: Path) -> int | None:
    """The step of a ``step_000010`` checkpoint directory (from its name), or None."""
    head, _, digits = ckpt.name.partition("_")
    return int(digits) if head == "step" and digits.isdigit() else None


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint, or None: the one ``latest`` names, unless a save was
    killed between renaming its checkpoint into place and updating ``latest``; then that
    checkpoint (of a higher step than ``latest``'s, and written after ``latest`` was: an older
    run's leftover of a higher step, whose metrics a resume dropped, was written before)."""
    root = checkpoint_root(run_dir)
    marker = root / "latest"
    done = sorted(p for p in root.glob("step_*") if (p / STATE_FILE).is_file())
    if marker.is_file():
        cand = root / marker.read_text().strip()
        if (cand / STATE_FILE).is_file():
            since, step = marker.stat().st_mtime_ns, checkpoint_step(cand) or 0
            later = [
                p
                for p in done
                if (checkpoint_step(p) or 0) > step and (p / STATE_FILE).stat().st_mtime_ns > since
            ]
            return later[-1] if later else cand
    return done[-1] if done else None


def _zip_problem(path: Path, name: str) -> str | None:
    """What makes the ``torch.save`` archive ``path`` unreadable (called ``name`` in the
    message), or None: the CRC of every entry of its zip archive is checked."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (OSError, zipfile.BadZipFile, RuntimeError) as exc:
        return f"{name} cannot be read: {exc}"
    if bad is not None:
        return f"{name} is corrupt (bad CRC in {bad})"
    return None


def sharded_problem(ckpt: Path, sub: str) -> str | None:
    """What makes the sharded checkpoint ``ckpt/sub`` (:func:`role_state`'s) unusable, or
    None; no tensor is read. Its ``.metadata`` must unpickle; every shard file it names must
    exist and hold ``offset + length`` bytes for each item stored in it (DCP's
    ``_StorageInfo``); ``rank_0.pt`` must be there, and every ``rank_<r>.pt`` pass its zip
    CRCs. The message names the file relative to ``ckpt``."""
    from torch.distributed.checkpoint import FileSystemReader

    where = ckpt / sub
    try:
        storage = FileSystemReader(str(where)).read_metadata().storage_data
    except Exception as exc:  # OSError, UnpicklingError, EOFError...: unusable all the same
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return f"{sub}/.metadata cannot be read: {text}"
    if not isinstance(storage, dict):
        return f"{sub}/.metadata names no shard files"
    need: dict[str, int] = {}  # shard file -> the bytes its items span
    for info in storage.values():
        end = info.offset + info.length
        need[info.relative_path] = max(need.get(info.relative_path, 0), end)
    for rel, end in sorted(need.items()):
        try:
            size = (where / rel).stat().st_size
        except FileNotFoundError:
            return f"{sub}/{rel} is missing (.metadata names it)"
        except OSError as exc:
            return f"{sub}/{rel} cannot be read: {exc.strerror or exc}"
        if size < end:
            return f"{sub}/{rel} is truncated ({size} bytes, .metadata needs {end})"
    if not (where / "rank_0.pt").is_file():
        return f"{sub}/rank_0.pt is missing (the scheduler and generator states)"
    for extra in sorted(where.glob("rank_*.pt")):
        if (problem := _zip_problem(extra, f"{sub}/{extra.name}")) is not None:
            return problem
    return None


def checkpoint_problem(ckpt: Path) -> str | None:
    """What makes ``ckpt`` unusable, or None: ``trainer_state.pt`` is read through (the CRC of
    every entry of its zip archive), the weights' safetensors headers and lengths are checked
    (:func:`relayrl.model.weights_problem`), and so is each ``sharded_<role>/`` checkpoint's
    ``.metadata`` against its shard files' lengths (:func:`sharded_problem`)."""
    if (problem := _zip_problem(ckpt / STATE_FILE, STATE_FILE)) is not None:
        return problem
    for role in sorted(p for p in ckpt.iterdir() if p.is_dir()):  # actor, critic; sft's model
        if role.name.startswith(SHARDED_PREFIX):
            problem = sharded_problem(ckpt, role.name)
        else:
            problem = weights_problem(role)
        if problem is not None:
            return problem.replace(f"{ckpt}/", "")
    return None


def intact_checkpoint(run_dir: str | Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest checkpoint without a :func:`checkpoint_problem`, and the newer ones passed
    over for theirs (newest first): what a resume falls back to, and why."""
    root = checkpoint_root(run_dir)
    newest = latest_checkpoint(run_dir)
    done = sorted((p for p in root.glob("step_*") if (p / STATE_FILE).is_file()), reverse=True)
    corrupt: list[tuple[Path, str]] = []
    for ckpt in [newest, *(p for p in done if p != newest)] if newest else []:
        problem = checkpoint_problem(ckpt)
        if problem is None:
            return ckpt, corrupt
        corrupt.append((ckpt, problem))
    return None, corrupt


def load_trainer_state(ckpt: Path) -> dict[str, Any]:
    return torch.load(ckpt / STATE_FILE, weights_only=False)


def _set_aside(root: Path, ckpt: Path) -> Path:
    """Rename checkpoint ``ckpt`` to ``root/.pruned_<name>`` (a leftover of that name removed
    first) and return the new path; the caller fsyncs ``root`` before deleting it."""
    aside = root / f"{PRUNED_PREFIX}{ckpt.name}"
    if aside.exists():
        shutil.rmtree(aside)
    os.rename(ckpt, aside)
    return aside


def _prune(root: Path, keep: int) -> None:
    """Keep the ``keep`` most recently written checkpoints (by write time, not step number:
    a fresh run in an old run directory must never delete what it just wrote). The others are
    renamed aside, ``root`` is fsynced (their renames on disk), then they are deleted; the
    leftovers of an earlier interrupted removal are deleted first."""
    for leftover in root.glob(f"{PRUNED_PREFIX}*"):
        shutil.rmtree(leftover, ignore_errors=True)
    done = sorted(
        (p for p in root.glob("step_*") if (p / STATE_FILE).is_file()),
        key=lambda p: (p / STATE_FILE).stat().st_mtime_ns,
    )
    aside = [_set_aside(root, old) for old in done[:-keep]]
    if aside:
        fsync_dir(root)
    for old in aside:
        shutil.rmtree(old, ignore_errors=True)
