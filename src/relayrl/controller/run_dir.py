"""A run directory belongs to one run: the lock, the refusals, the config it keeps.

:func:`claim_run_dir` is the first thing a run does, before it writes anything into
``run_dir``:

1. ``run_dir/.lock`` is locked with ``fcntl.flock`` (exclusive, non-blocking) for the life of
   the run. Another process on the same directory, started or resumed, refuses in one line
   naming the holder's pid. (``flock`` is per machine on some network filesystems.)
2. A start without ``resume`` where a run already is (a checkpoint, or a ``metrics.jsonl``
   with records) refuses, naming the choices: ``--resume``, another ``run_dir=...``, or
   ``--overwrite``, which moves the old run's files into ``<run_dir>.prev-N`` beside it (never
   deletes them). The ``config.yaml`` of a start that failed before it logged anything (a bad
   data path, say) is no run: the next start goes ahead and keeps it as ``config.prev-N.yaml``.
3. ``resume`` with ``train.steps`` at or below the newest checkpoint's step refuses: there is
   nothing to train (unless the run stopped after that step's checkpoint and before its final
   evaluation: then the resume only evaluates and ends the run). ``resume`` where a run is but
   no checkpoint (a job that died before its first save) moves its files aside and starts at
   step 0, so a restarted job loses nothing;
   ``resume`` where no run is at all (a missing, empty or mistyped directory) refuses, naming
   what it looked for. ``resume`` with a config whose identity keys (``RESUME_IDENTITY``: the
   model, the critic, the algorithm, the prompt format) differ from the run's ``config.yaml``
   refuses, listing them, unless the change is accepted (``--allow-config-change``).
4. Only then are the leftovers of interrupted checkpoint writes removed (the lock rules out a
   writer), a torn last line (a kill or a power loss mid-append) cut off the appended logs
   (``metrics.jsonl``, ``trajectories.jsonl``) so that nothing is appended after it, the
   trajectories of the steps the run trains again moved out of ``trajectories.jsonl`` (below),
   and the holder's pid written into the lock file. ``--overwrite``'s move into ``.prev-N`` and the
   renaming of an unreadable checkpoint to ``corrupt_<name>`` are fsynced (their directories,
   after the renames) before the run writes anything.

A resume from the checkpoint of step S trains steps S+1.. again: ``metrics.jsonl`` drops its
records past S (``MetricsLogger``), and the claim moves the rows of ``trajectories.jsonl`` with
``step >= S`` (the trainer's 0-based step: the row of step S+1 says ``S``) into
``trajectories.rewound-<S>.jsonl`` beside it (``trajectories.rewound-<S>.<k>.jsonl`` when that is
taken), kept: the data of a training path the run no longer follows, never appended to
(``relayrl.durable.split_jsonl_log``: streamed, the new file and then the log fsynced and renamed
in, each rename's directory fsynced). A start at step 0 (no checkpoint) moves every row so.

A refused start leaves every file byte-identical: the lock file is opened without truncation
(created empty when missing) and written only once the checks have passed.

:func:`record_config` then writes ``config.yaml`` atomically and durably (fsynced before its
rename, the run directory after it; the run directory itself fsynced into its parent when the
claim creates it: ``relayrl.model.atomic_dir``). On a resume whose config differs from the one
in the directory, the earlier one is kept as ``config.prev-N.yaml``: ``config.yaml`` is always
the config of the newest continuation, and the history stays.
"""

from __future__ import annotations

import errno
import fcntl
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml
from pydantic import BaseModel

from relayrl.config import dump_config
from relayrl.controller.checkpoint import (
    RUN_LOGS,
    STATE_FILE,
    checkpoint_root,
    checkpoint_step,
    intact_checkpoint,
    remove_partial_writes,
)
from relayrl.controller.faults import RunDirError
from relayrl.durable import (
    end_at_last_line,
    fsync_dir,
    fsync_file,
    mkdir_durable,
    replace_durable,
    split_jsonl_log,
)
from relayrl.model import finish_interrupted_save
from relayrl.model.atomic_dir import OLD_PREFIX

__all__ = [
    "LOCK_FILE",
    "RESUME_IDENTITY",
    "RUN_FILES",
    "RunDir",
    "claim_output_dir",
    "claim_run_dir",
    "config_changes",
    "output_dir_locked",
    "record_config",
]

LOCK_FILE = ".lock"
CHECKPOINTS = "checkpoints"
RUN_FILES = ("config.yaml", "metrics.jsonl", "timeline.json")
"""The files of a run (besides its checkpoints), named in the refusal and moved aside."""
RESUME_IDENTITY = (
    "model.path",
    "model.critic_path",
    "algo.name",
    "data.source.chat_template",
    "data.source.system_prompt",
)
"""Keys a resume may not change silently: the reference model, the algorithm and the prompt
format the checkpoint was trained with."""


@dataclass
class RunDir:
    """A claimed run directory: locked until :meth:`release` (or the end of a ``with``)."""

    path: Path
    checkpoint: Path | None = None
    """The checkpoint to resume from (``resume`` only)."""
    moved_to: Path | None = None
    """Where an earlier run's files were moved (``--overwrite``, or a resume without one)."""
    removed: list[Path] = field(default_factory=list)
    """Leftovers of interrupted checkpoint writes, removed at the claim."""
    corrupt: list[tuple[Path, str, Path]] = field(default_factory=list)
    """Checkpoints newer than ``checkpoint`` that cannot be read (``resume`` only): where each
    was, why, and where it was moved (``corrupt_step_N``, kept, never resumed from)."""
    recovered: list[str] = field(default_factory=list)
    """What a ``relayrl sft`` killed in its final save left, set right at the claim
    (``finish_interrupted_save``: its ``checkpoints/`` carried back into ``output_dir``); for a
    run directory, a torn last line cut off its appended logs (``metrics.jsonl``,
    ``trajectories.jsonl``), in words."""
    _fd: int | None = None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def __enter__(self) -> RunDir:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


def _not_writable(path: Path, exc: OSError, what: str = "run directory") -> RunDirError:
    return RunDirError(f"{what} {path} cannot be written ({exc.strerror or exc})")


def _lock(
    path: Path, lock: Path | None = None, what: str = "run directory", key: str = "run_dir"
) -> int:
    """The locked descriptor of ``lock`` (default ``path/.lock``); RunDirError when another
    process holds it (naming ``what`` it is and the config ``key`` to choose another)."""
    lock = lock or path / LOCK_FILE
    try:
        mkdir_durable(lock.parent)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise _not_writable(path, exc, what) from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise _not_writable(path, exc, what) from exc
        raise RunDirError(
            f"{what} {path} is in use by another relayrl run (pid {_holder(lock)}); wait "
            f"for it to end, or choose another {key}=..."
        ) from None
    try:  # the holder's pid, written at once: a process refused now can name it
        pid = f"{os.getpid()}\n".encode()
        os.pwrite(fd, pid, 0)
        os.ftruncate(fd, len(pid))
    except OSError as exc:
        os.close(fd)
        raise _not_writable(path, exc) from exc
    return fd


def _holder(lock: Path, wait_s: float = 0.5) -> str:
    """The pid in a held lock file. The holder writes it just after taking the lock, so a
    process refused in between finds the file empty (or a finished run's pid being
    overwritten): read again for up to ``wait_s`` before saying "unknown"."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            text = lock.read_text().strip()
        except OSError:
            text = ""
        if text.isdigit() or time.monotonic() >= deadline:
            return text if text.isdigit() else "unknown"
        time.sleep(0.01)


def _contents(path: Path) -> list[str]:
    """What of a run is in ``path``: its files and checkpoints, for the refusal message."""
    found = [name for name in RUN_FILES if (path / name).exists()]
    steps = sorted(p.name for p in checkpoint_root(path).glob("step_*") if p.is_dir())
    if steps:
        found.insert(0, f"checkpoints up to {steps[-1]}")
    return found


def _holds_run(path: Path) -> bool:
    """A checkpoint, or logged records: what a new start must not touch."""
    metrics = path / "metrics.jsonl"
    has_records = metrics.is_file() and metrics.stat().st_size > 0
    return has_records or any(p.is_dir() for p in checkpoint_root(path).glob("step_*"))


def _aside(path: Path) -> Path:
    """A free ``<run_dir>.prev-N`` beside ``path`` (created, so two claims never share it)."""
    base = path.resolve()
    n = 1
    while True:
        dest = base.with_name(f"{base.name}.prev-{n}")
        try:
            dest.mkdir()
            return dest
        except FileExistsError:
            n += 1


def _move_aside(path: Path) -> Path:
    """Move every entry of ``path`` but the lock into a new ``<run_dir>.prev-N``; the lock
    stays held the whole time, so no other run sees the directory half-moved. Durably: the new
    directory fsynced into its parent before the moves, then ``.prev-N`` after them (the
    moved entries on disk there) before ``path`` (gone from it): a power loss never loses an
    entry from both."""
    dest = _aside(path)
    fsync_dir(dest.parent)
    for entry in sorted(path.iterdir()):
        if entry.name != LOCK_FILE:
            os.rename(entry, dest / entry.name)
    fsync_dir(dest)
    fsync_dir(path)
    return dest


def _keep_corrupt(run: RunDir, corrupt: list[tuple[Path, str]]) -> None:
    """Rename each unreadable checkpoint to ``corrupt_<name>`` beside it (kept, never resumed
    from), then fsync their directory: the renames on disk before the resume writes anything."""
    for ckpt, problem in corrupt:
        kept = ckpt.with_name(f"corrupt_{ckpt.name}")
        os.rename(ckpt, kept)
        run.corrupt.append((ckpt, problem, kept))
    for parent in sorted({ckpt.parent for ckpt, _ in corrupt}):
        fsync_dir(parent)


def _end_logs_at_last_line(run: RunDir) -> None:
    """Cut a torn last line (an append cut short by a kill or a power loss) off the run's
    appended logs before anything is appended to them (``relayrl.durable.end_at_last_line``);
    what was done goes to ``run.recovered``."""
    for name in RUN_LOGS:
        if (done := end_at_last_line(run.path / name)) is not None:
            run.recovered.append(done)


def _rewind_trajectories(run: RunDir) -> None:
    """Move the rows of ``trajectories.jsonl`` of the steps after the checkpoint resumed from,
    S (0 without one; their ``step`` field, 0-based, at least S), into a new
    ``trajectories.rewound-<S>.jsonl`` (module docstring); said in ``run.recovered``."""
    path, step = run.path / RUN_LOGS[1], checkpoint_step(run.checkpoint) if run.checkpoint else 0
    if not path.is_file() or step is None:
        return
    aside, k = run.path / f"trajectories.rewound-{step}.jsonl", 1
    while aside.exists():
        k += 1
        aside = run.path / f"trajectories.rewound-{step}.{k}.jsonl"

    def keep(row: Any) -> bool:
        at = row.get("step") if isinstance(row, dict) else None
        return not isinstance(at, int) or at < step

    _, moved = split_jsonl_log(path, keep, aside)
    if moved:
        run.recovered.append(
            f"moved the {moved} trajectories of the steps after {step} (trained again) from "
            f"{path} to {aside}"
        )


def _dotted(tree: Any, key: str) -> Any:
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


def _same(key: str, old: Any, new: Any) -> bool:
    if key.endswith("path") and isinstance(old, str) and isinstance(new, str):
        return os.path.realpath(old) == os.path.realpath(new)  # runs/sft == /abs/runs/sft
    return bool(old == new)


def config_changes(run_dir: str | Path, cfg: BaseModel) -> list[str]:
    """``key (old -> new)`` for each of ``RESUME_IDENTITY`` that ``cfg`` changes from the
    run's ``config.yaml`` (none when the directory keeps no config, or keeps no such key)."""
    path = Path(run_dir) / "config.yaml"
    try:
        old = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return []
    new = cfg.model_dump(mode="json", by_alias=True)
    changes = []
    for key in RESUME_IDENTITY:
        before, after = _dotted(old, key), _dotted(new, key)
        if _dotted(old, key.rsplit(".", 1)[0]) is None and before is None:
            continue  # a config written before the key existed
        if not _same(key, before, after):
            changes.append(f"{key} ({before!r} -> {after!r})")
    return changes


def claim_run_dir(
    run_dir: str | Path,
    *,
    resume: bool = False,
    overwrite: bool = False,
    steps: int | None = None,
    cfg: BaseModel | None = None,
    allow_config_change: bool = False,
) -> RunDir:
    """Lock ``run_dir`` for this process and check it may be used as asked (module docstring).

    Args:
        resume: continue from the newest checkpoint (``--resume``).
        overwrite: move an existing run aside first (``--overwrite``); not with ``resume``.
        steps: ``train.steps``; with ``resume`` it must exceed the checkpoint's step.
        cfg: the run's config; with ``resume`` its ``RESUME_IDENTITY`` keys must equal the
            run's own, unless ``allow_config_change`` (``--allow-config-change``).

    Raises :class:`RunDirError` (one line, nothing written) when it may not.
    """
    path = Path(run_dir)
    if resume and overwrite:
        raise RunDirError(
            "--resume continues the run in run_dir and --overwrite moves it aside: pass one"
        )
    if resume and not path.is_dir():
        raise RunDirError(_nothing_to_resume(path, "does not exist"))
    fd = _lock(path)
    run = RunDir(path, _fd=fd)
    corrupt: list[tuple[Path, str]] = []
    try:
        found = _contents(path)
        if resume:
            run.checkpoint, corrupt = intact_checkpoint(path)
            if run.checkpoint is None and corrupt:
                why = "; ".join(f"{p.name}: {problem}" for p, problem in corrupt)
                raise RunDirError(f"--resume: no checkpoint in {path} can be read ({why})")
            if run.checkpoint is None and not _holds_run(path):
                raise RunDirError(_nothing_to_resume(path, "holds no run"))
            changes = config_changes(path, cfg) if cfg is not None and run.checkpoint else []
            if changes and not allow_config_change:
                raise RunDirError(
                    f"--resume: the config changes what the run in {path} was trained with: "
                    f"{', '.join(changes)}; start a new run (run_dir=... or --overwrite), or "
                    "pass --allow-config-change to continue with the change"
                )
            done = checkpoint_step(run.checkpoint) if run.checkpoint else None
            ended = done is None or steps != done or not _stopped_before_final_eval(path, done)
            if done is not None and steps is not None and steps <= done and ended:
                raise RunDirError(
                    f"--resume: the newest checkpoint {run.checkpoint} is at step {done} and "
                    f"train.steps={steps} asks for no more; set train.steps above {done} to "
                    "train further"
                )
        elif _holds_run(path) and not overwrite:
            dest = _aside_name(path)
            raise RunDirError(
                f"run directory {path} already holds a run ({', '.join(found)}); continue it "
                f"with --resume, start elsewhere with run_dir=..., or pass --overwrite to move "
                f"it to {dest}"
            )
        try:
            if found and (overwrite or (resume and not run.checkpoint and _holds_run(path))):
                run.moved_to = _move_aside(path)
            _keep_corrupt(run, corrupt)
            _end_logs_at_last_line(run)
            run.removed = remove_partial_writes(path)
            leftovers = (".config.yaml.*.tmp", ".metrics.jsonl.tmp", ".trajectories.*.tmp")
            for tmp in [p for pattern in leftovers for p in path.glob(pattern)]:
                tmp.unlink()
                run.removed.append(tmp)
            _rewind_trajectories(run)
        except OSError as exc:
            raise _not_writable(path, exc) from exc
    except BaseException:
        run.release()
        raise
    return run


def claim_output_dir(
    output_dir: str | Path,
    overwrite: bool = False,
    resume: bool = False,
    steps: int | None = None,
) -> RunDir:
    """The rules of a run directory for a model's output directory (``relayrl sft``), checked
    before the first step: one that holds anything is refused (``RunDirError`` naming what is
    there) unless ``overwrite``, which moves it to ``<output_dir>.prev-N`` (never deletes it;
    ``moved_to``), or ``resume``, which continues from its newest intact checkpoint
    (``checkpoint``; refused when there is none, or when ``steps`` asks for no more, unless
    the model of that last step is not in ``output_dir``: its save failed); then the
    directory that will receive the model must take a file (a read-only or impossible target
    is refused now, not after the training). The directory is locked as a run directory is
    (a second ``relayrl sft`` on it, or its ``--resume``, is refused while this one runs), with
    :func:`output_lock` beside it, until :meth:`RunDir.release`."""
    out = Path(output_dir)
    swapping = out.parent.is_dir() and any(out.parent.glob(f"{OLD_PREFIX}{out.name}_*"))
    if resume and not out.is_dir() and not swapping:  # refused before anything is written
        raise RunDirError(_nothing_to_resume(out, "does not exist", "output directory"))
    fd = _lock_output(out)
    try:
        recovered = _finish_save(out, (CHECKPOINTS,))  # a run killed in its final save
        run = _resume_output(out, overwrite, steps) if resume else _claim_output(out, overwrite)
    except BaseException:
        if fd is not None:
            os.close(fd)
        raise
    run.recovered, run._fd = recovered, fd
    return run


def output_lock(out: Path) -> Path:
    """The lock file of ``relayrl sft``'s ``output_dir``: ``.<name>.lock`` beside it, not in it
    (the final save swaps the directory and ``--overwrite`` moves it aside: a lock file in it
    would go with it, and another run could lock a new one meanwhile)."""
    return out.parent / f".{out.name}.lock"


def _finish_save(out: Path, keep: tuple[str, ...]) -> list[str]:
    """What a writer of ``out`` killed in its final save left, completed
    (``finish_interrupted_save``; ``keep``: what the save carries over, e.g. ``checkpoints/``),
    in words; ``RunDirError`` when it cannot be. Only under ``out``'s lock."""
    try:
        return finish_interrupted_save(out, keep=keep)
    except OSError as exc:
        raise RunDirError(f"output directory {out} cannot be written ({exc.strerror})") from None


@contextmanager
def output_dir_locked(output_dir: str | Path, keep: tuple[str, ...] = ()) -> Iterator[list[str]]:
    """``output_dir`` locked for the block as :func:`claim_output_dir` locks it (
    :func:`output_lock` beside it): ``RunDirError`` naming the holder when another process
    holds it. Then, as the claim does, what a run killed in its final save left beside it is
    completed (its new directory put in place, ``keep``'s entries carried back): the lines
    saying so are what the block gets. For the writers of a whole output directory that claim
    nothing else (``relayrl rm``; ``run_sft`` called without ``relayrl sft``'s claim: the labs,
    ``relayrl demo``)."""
    out = Path(output_dir)
    fd = _lock_output(out)
    try:
        yield _finish_save(out, keep)
    finally:
        if fd is not None:
            os.close(fd)  # closing the descriptor drops the flock


def _lock_output(out: Path) -> int | None:
    """The locked descriptor of :func:`output_lock`; None when ``out``'s parent cannot be made
    (:func:`_claim_output` then refuses ``out`` with the reason)."""
    above = out.parent
    while not above.exists() and above != above.parent:
        above = above.parent
    if not above.is_dir():
        return None
    return _lock(out, output_lock(out), "output directory", "output_dir")


def _claim_output(out: Path, overwrite: bool) -> RunDir:
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    above = out
    while not above.exists() and above != above.parent:
        above = above.parent
    if not above.is_dir():
        where = "is a file" if above == out else f"cannot be created ({above} is a file)"
        raise RunDirError(f"output directory {out} {where}; choose another output_dir=...")
    moved: Path | None = None
    if held and not overwrite:
        shown = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
        raise RunDirError(
            f"output directory {out} already holds {shown}; choose another output_dir=..., or "
            f"pass --overwrite to move it to {_aside_name(out)}"
        )
    try:
        if held:
            moved = _move_aside(out)  # every file kept as it was
        out.parent.mkdir(parents=True, exist_ok=True)
        probe = out.parent / f".write_probe_{out.name}_{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise RunDirError(
            f"output directory {out} cannot be written ({exc.strerror or exc})"
        ) from None
    return RunDir(out, moved_to=moved)


def _resume_output(out: Path, overwrite: bool, steps: int | None) -> RunDir:
    if overwrite:
        raise RunDirError("--resume continues the run in output_dir and --overwrite moves it aside")
    if not out.is_dir():
        raise RunDirError(_nothing_to_resume(out, "does not exist", "output directory"))
    ckpt, corrupt = intact_checkpoint(out)
    if ckpt is None and corrupt:
        why = "; ".join(f"{p.name}: {problem}" for p, problem in corrupt)
        raise RunDirError(f"--resume: no checkpoint in {out} can be read ({why})")
    if ckpt is None:
        raise RunDirError(_nothing_to_resume(out, "holds no checkpoint", "output directory"))
    done = checkpoint_step(ckpt)
    unsaved = done == steps and not _model_saved_after(out, ckpt)  # the final save failed
    if done is not None and steps is not None and steps <= done and not unsaved:
        raise RunDirError(
            f"--resume: the newest checkpoint {ckpt} is at step {done} and steps={steps} asks "
            f"for no more; set steps above {done} to train further"
        )
    run = RunDir(out, checkpoint=ckpt)
    try:
        _keep_corrupt(run, corrupt)
        run.removed = remove_partial_writes(out)
    except OSError as exc:
        raise RunDirError(f"output directory {out} cannot be written ({exc.strerror})") from None
    return run


def _stopped_before_final_eval(path: Path, done: int) -> bool:
    """Whether the run in ``path`` stopped after its last step's checkpoint but before its
    final evaluation: the last record of ``metrics.jsonl`` is the training record of step
    ``done`` (a resume at that step only evaluates and ends the run)."""
    from relayrl.telemetry.metrics import read_metrics

    try:
        records = read_metrics(path)
    except (OSError, ValueError):
        return False
    return bool(records) and records[-1].get("step") == done and "reward_mean" in records[-1]


def _model_saved_after(out: Path, ckpt: Path) -> bool:
    """Whether ``out`` holds a model written after checkpoint ``ckpt`` (``relayrl sft`` writes
    its final checkpoint, then the model: a resume at that step only writes a missing model)."""
    config = out / "config.json"
    if not config.is_file():
        return False
    return config.stat().st_mtime_ns >= (ckpt / STATE_FILE).stat().st_mtime_ns


def _nothing_to_resume(path: Path, why: str, what: str = "run directory") -> str:
    key = "output_dir" if what == "output directory" else "run_dir"
    return (
        f"--resume: {what} {path} {why}: no checkpoint to continue (looked for "
        f"{checkpoint_root(path)}/step_*/trainer_state.pt); check {key}=..., or start a new "
        "run without --resume"
    )


def _aside_name(path: Path) -> Path:
    """The ``.prev-N`` name :func:`_move_aside` would pick now (for the refusal message)."""
    base = path.resolve()
    n = 1
    while base.with_name(f"{base.name}.prev-{n}").exists():
        n += 1
    return base.with_name(f"{base.name}.prev-{n}")


def record_config(run_dir: str | Path, cfg: BaseModel) -> Path:
    """Write ``cfg`` to ``run_dir/config.yaml`` atomically and durably (the new file fsynced,
    renamed in, ``run_dir`` fsynced: both renames on disk when this returns); a different
    earlier config is kept as ``config.prev-N.yaml`` (a resume with other settings keeps the
    history). A failed write (a full disk) is a :class:`RunDirError`: nothing has run yet."""
    path = Path(run_dir) / "config.yaml"
    tmp = path.with_name(f".config.yaml.{os.getpid()}.tmp")
    try:
        dump_config(cfg, tmp)
        if path.exists() and path.read_bytes() == tmp.read_bytes():
            tmp.unlink()
            return path
        fsync_file(tmp)
        if path.exists():
            n = 1
            while path.with_name(f"config.prev-{n}.yaml").exists():
                n += 1
            os.rename(path, path.with_name(f"config.prev-{n}.yaml"))
        replace_durable(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise _not_writable(path.parent, exc) from exc
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
