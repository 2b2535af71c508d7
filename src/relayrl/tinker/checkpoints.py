"""``tinker://`` checkpoints on local disk, written atomically, readable after a restart.

Layout under the service's state directory (``--state-dir``)::

    <model_id>/weights/<name>/           save_state: trainable.safetensors, optimizer.pt, meta.json
    <model_id>/sampler_weights/<name>/   save_weights_for_sampler: a Hugging Face model directory
                                         (adapter merged; ``from_pretrained`` loads it) + meta.json

meta.json holds what loading needs (base model, LoRA rank and targets, steps), the run's
``user_metadata`` (``create_lora_training_client(user_metadata=)``: a run known after a
restart from its checkpoints) and, under ``checkpoint_user_metadata``, the checkpoint's own
(``save_state`` / ``save_weights_for_sampler(..., user_metadata=)``; an overwrite replaces it,
or drops it when the new save has none, as Tinker), listed as the SDK's
``Checkpoint.user_metadata``.

A checkpoint is written into a temporary sibling directory and renamed into place (after an
fsync of its files) by ``relayrl.model.atomic_dir.write_dir_atomic``, the save of ``relayrl
sft``'s model too: a reader sees the old checkpoint or the new one, never half of one, and a
service killed between renaming the old one away and the new one in has it put in place when
it starts again (:meth:`CheckpointStore.finish_interrupted`).
``tinker://<model_id>/weights/<name>`` names the first kind,
``tinker://<model_id>/sampler_weights/<name>`` the second.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from relayrl.durable import fsync_dir
from relayrl.model.atomic_dir import finish_interrupted_saves, pid_alive, write_dir_atomic

KINDS = {"weights": "training", "sampler_weights": "sampler"}
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


class CheckpointError(ValueError):
    """A bad ``tinker://`` path or a checkpoint that is not there (a user error)."""


@dataclass(frozen=True)
class CheckpointPath:
    model_id: str
    kind: str
    name: str

    @property
    def uri(self) -> str:
        return f"tinker://{self.model_id}/{self.kind}/{self.name}"

    @staticmethod
    def parse(uri: str) -> CheckpointPath:
        if not uri.startswith("tinker://"):
            raise CheckpointError(f"checkpoint path must start with tinker://, got {uri!r}")
        parts = uri[len("tinker://") :].split("/")
        if len(parts) != 3 or parts[1] not in KINDS or not _NAME.match(parts[2]):
            raise CheckpointError(
                f"checkpoint path must be tinker://<model_id>/weights|sampler_weights/<name>, "
                f"got {uri!r}"
            )
        return CheckpointPath(parts[0], parts[1], parts[2])


UserMetadata = dict[str, str] | None
"""A checkpoint's own ``user_metadata`` (the SDK's ``Checkpoint.user_metadata``)."""


def check_user_metadata(raw: Any) -> UserMetadata:
    """A save's ``user_metadata`` as sent (None or a JSON object of strings to strings); any
    other value is a CheckpointError (a user error)."""
    if raw is None:
        return None
    if not isinstance(raw, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in raw.items()
    ):
        raise CheckpointError(f"user_metadata must map strings to strings, got {raw!r}")
    return dict(raw)


def check_name(name: str) -> str:
    if not _NAME.match(name):
        raise CheckpointError(
            f"checkpoint name {name!r}: use 1-128 letters, digits, '.', '_' or '-'"
        )
    return name


class CheckpointStore:
    """The checkpoints of every model of a service, under one directory."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.recovered = self.finish_interrupted()

    def finish_interrupted(self) -> list[str]:
        """Complete the checkpoint writes a killed service left (``finish_interrupted_save``:
        a checkpoint renamed away and its replacement not yet renamed in is put back in
        place; a checkpoint a killed delete had renamed aside, ``.deleted_<name>_<pid>_*``, is
        removed); what was done, in words."""
        done = []
        for model in sorted(d for d in self.root.iterdir() if d.is_dir()):
            for kind in KINDS:
                done += finish_interrupted_saves(model / kind)
                for aside in sorted((model / kind).glob(".deleted_*")):  # a killed delete
                    pid = aside.name.rsplit("_", 2)[-2]
                    if pid.isdigit() and not pid_alive(int(pid)):
                        shutil.rmtree(aside, ignore_errors=True)
                        done.append(f"removed {aside.name}, left by an interrupted delete")
        return done

    def dir_of(self, path: CheckpointPath) -> Path:
        return self.root / path.model_id / path.kind / path.name

    def write(
        self,
        path: CheckpointPath,
        fill: Callable[[Path], None],
        meta: dict[str, Any],
        user_metadata: Any = None,
    ) -> Path:
        """``fill(tmp_dir)`` writes the files, then meta.json (``meta``, the time and the
        checkpoint's own ``user_metadata``, checked first: :func:`check_user_metadata`); the
        swap is :func:`relayrl.model.atomic_dir.write_dir_atomic`'s (fsync, then rename)."""
        own = check_user_metadata(user_metadata)

        def write_all(tmp: Path) -> None:
            fill(tmp)
            full = {**meta, "time": time.time(), "checkpoint_user_metadata": own}
            (tmp / "meta.json").write_text(json.dumps(full, indent=1))

        return write_dir_atomic(self.dir_of(path), write_all)

    def check_free(self, path: CheckpointPath, replace: str) -> None:
        """A CheckpointError (a user error) if the checkpoint is there (its meta.json, written
        last, is): Tinker refuses a name saved already (its server answers 409 "Checkpoint
        ... already exists ... choose a different name"); ``replace``: the call that would
        replace it, named in the message."""
        if (self.dir_of(path) / "meta.json").is_file():
            raise CheckpointError(
                f"checkpoint {path.name!r} already exists for model {path.model_id} in "
                f"{path.kind} ({path.uri}); choose a different name, or {replace} to replace it"
            )

    def read(self, path: CheckpointPath) -> tuple[Path, dict[str, Any]]:
        """The checkpoint's directory and its meta.json; a missing one is a CheckpointError."""
        d = self.dir_of(path)
        if not (d / "meta.json").is_file():
            raise CheckpointError(f"no checkpoint at {path.uri}")
        return d, json.loads((d / "meta.json").read_text())

    def model_ids(self) -> list[str]:
        """The model ids with at least one checkpoint on disk, sorted."""
        return sorted(
            d.name
            for d in self.root.iterdir()
            if d.is_dir() and not d.name.startswith(".") and self.list(d.name)
        )

    def deletable(self, path: CheckpointPath) -> Path:
        """The checkpoint's directory; a CheckpointError if it is not there or resolves outside
        ``root/<model_id>/<kind>/`` (``..``, a symlink)."""
        d = self.dir_of(path)
        root = self.root.resolve()
        inside = d.exists() and not d.is_symlink() and d.resolve().parent.parent.parent == root
        if not inside or not (d / "meta.json").is_file():
            raise CheckpointError(f"unknown checkpoint {path.uri}")
        return d

    def delete(self, path: CheckpointPath) -> None:
        """Remove a :meth:`deletable` checkpoint: renamed aside (readers see it whole or not at
        all), then removed."""
        d = self.deletable(path)
        aside = d.parent / f".deleted_{path.name}_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        os.replace(d, aside)
        fsync_dir(d.parent)
        shutil.rmtree(aside, ignore_errors=True)

    def list(self, model_id: str) -> list[dict[str, Any]]:
        """The model's checkpoints as the SDK's ``Checkpoint`` JSON (their own
        ``user_metadata`` too), oldest first."""
        out = []
        for kind, ctype in KINDS.items():
            base = self.root / model_id / kind
            if not base.is_dir():
                continue
            for d in base.iterdir():
                if d.name.startswith("."):
                    continue
                try:
                    meta = json.loads((d / "meta.json").read_text())
                    size = sum(f.stat().st_size for f in d.iterdir() if f.is_file())
                except FileNotFoundError:  # being written, or deleted since iterdir
                    continue
                out.append(
                    {
                        "checkpoint_id": f"{kind}/{d.name}",
                        "checkpoint_type": ctype,
                        "time": datetime.fromtimestamp(meta["time"], UTC).isoformat(),
                        "tinker_path": CheckpointPath(model_id, kind, d.name).uri,
                        "size_bytes": size,
                        "public": False,
                        "user_metadata": meta.get("checkpoint_user_metadata"),
                    }
                )
        return sorted(out, key=lambda c: str(c["time"]))
