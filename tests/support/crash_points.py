"""Run ``relayrl ARGV`` in this process, parked at a chosen point for a SIGKILL from outside.

``python crash_points.py POINT N MARKER -- ARGV...``: the N-th time the run reaches ``POINT``
it creates ``MARKER`` and waits there (a sleep loop: the test kills the process, it never ends
by itself). Points:

- ``update``: the actor's update (``ActorWorker.update``), before any weight changes;
- ``ckpt_write``: ``save_checkpoint`` after the first file of the checkpoint is written
  (``config.json`` of its first model, in the temporary directory);
- ``ckpt_commit``: after the checkpoint directory is renamed into place, before ``latest``;
- ``sft_carry``: ``relayrl sft``'s final save, just after ``checkpoints/`` was moved (into the
  new directory, or out of the old one: where ``save_model_atomic`` carries it);
- ``sft_old``: a whole-directory save (``relayrl.model.atomic_dir.write_dir_atomic``: the final
  save of ``relayrl sft`` and ``relayrl rm``, a tinker checkpoint), just after the old
  directory was renamed away, before the new one is renamed in;
- ``sft_forward``: an SFT step's forward pass;
- ``eval``: a held-out evaluation of ``relayrl train`` (the first is step 0's).

``ARGV`` ``tinker-store ROOT TAG``: a tinker checkpoint written (:func:`tinker_store`), not a
``relayrl`` command. :func:`kill_at` runs this script and SIGKILLs it where it parks.

``$RELAYRL_RECORD_TAKES=file``: also record the admission ids each async step trains
(:func:`record_takes`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def _park(marker: str) -> None:
    Path(marker).write_text(f"{os.getpid()}\n")
    while True:
        time.sleep(1)


def _counting(point: str, nth: int, marker: str) -> Any:
    calls = {"n": 0}

    def hit() -> None:
        calls["n"] += 1
        if calls["n"] == nth:
            _park(marker)

    return hit


def install(point: str, nth: int, marker: str) -> None:
    hit = _counting(point, nth, marker)
    if point == "update":
        from relayrl.workers.actor import ActorWorker

        real_update = ActorWorker.update

        def update(self: Any, exp: Any) -> Any:
            hit()
            return real_update(self, exp)

        ActorWorker.update = update  # type: ignore[method-assign]
    elif point == "ckpt_write":
        from transformers import PretrainedConfig

        real_cfg_save = PretrainedConfig.save_pretrained

        def cfg_save(self: Any, save_directory: Any, *a: Any, **k: Any) -> Any:
            out = real_cfg_save(self, save_directory, *a, **k)
            if ".tmp_step_" in str(save_directory):
                hit()
            return out

        PretrainedConfig.save_pretrained = cfg_save  # type: ignore[method-assign]
    elif point in ("ckpt_commit", "sft_carry", "sft_old"):
        real_replace = os.replace
        real_rename = os.rename

        def replace(src: Any, dst: Any, *a: Any, **k: Any) -> Any:
            out = real_replace(src, dst, *a, **k)
            if point == "ckpt_commit" and Path(dst).name.startswith("step_"):
                hit()
            if point == "sft_old" and Path(dst).name.startswith(".old_"):
                hit()
            return out

        def rename(src: Any, dst: Any, *a: Any, **k: Any) -> Any:
            out = real_rename(src, dst, *a, **k)
            if point == "sft_carry" and Path(dst).name == "checkpoints":
                hit()
            return out

        os.replace = replace
        os.rename = rename
    elif point == "eval":
        from relayrl.controller import trainer

        real_eval = trainer.held_out_metrics

        def held_out(*a: Any, **k: Any) -> Any:
            hit()
            return real_eval(*a, **k)

        trainer.held_out_metrics = held_out
    elif point == "sft_forward":
        from relayrl.controller import sft

        real_forward = sft.forward_logprobs

        def forward(*a: Any, **k: Any) -> Any:
            hit()
            return real_forward(*a, **k)

        sft.forward_logprobs = forward
    else:
        raise SystemExit(f"unknown point {point}")


def kill_at(point: str, nth: int, argv: list[str], tmp: Path, env: dict | None = None) -> None:
    """Run ``relayrl ARGV`` until it reaches ``point`` the ``nth`` time, then SIGKILL it."""
    marker = tmp / f"parked_{point}_{nth}"
    marker.unlink(missing_ok=True)
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), point, str(nth), str(marker), "--", *argv],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    while not marker.exists():
        if proc.poll() is not None:
            raise AssertionError(
                f"ended before {point} #{nth} ({proc.returncode}): {proc.stderr.read()}"
            )
        assert time.monotonic() < deadline, f"{point} #{nth} not reached"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the trainer and any worker of it
    assert proc.wait(timeout=60) == -signal.SIGKILL


def tinker_store(root: str, tag: str) -> int:
    """``tinker-store ROOT TAG``: write ``tinker://m/weights/w`` (meta ``tag``) into the
    tinker checkpoint store at ``ROOT``, as the service's ``save_state`` does."""
    from relayrl.tinker.checkpoints import CheckpointPath, CheckpointStore

    def fill(d: Path) -> None:
        (d / "trainable.safetensors").write_text(tag)

    CheckpointStore(root).write(CheckpointPath("m", "weights", "w"), fill, {"tag": tag})
    return 0


def record_takes(path: str) -> None:
    """Append the admission ids of every batch the async buffer hands to training to ``path``
    (``{"pid", "ids"}`` a line), flushed at once: what a killed run trained survives it."""
    import json

    from relayrl.controller.buffer import GroupBuffer

    real_take = GroupBuffer.take

    def take(self: Any, n: int, *a: Any, **k: Any) -> Any:
        out = real_take(self, n, *a, **k)
        with open(path, "a") as f:
            ids = [g.admission_index for g in out]
            f.write(json.dumps({"pid": os.getpid(), "ids": ids}) + "\n")
        return out

    GroupBuffer.take = take  # type: ignore[method-assign]


if __name__ == "__main__":
    point, nth, marker, sep, *argv = sys.argv[1:]
    assert sep == "--"
    sys.path.insert(0, str(Path(__file__).parent))  # tiny_runs (the reward function)
    install(point, int(nth), marker)
    if takes := os.environ.get("RELAYRL_RECORD_TAKES"):
        record_takes(takes)
    if argv[0] == "tinker-store":
        sys.exit(tinker_store(*argv[1:]))
    from relayrl.cli import main

    sys.exit(main(argv))
