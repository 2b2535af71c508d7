"""A checkpoint's own ``user_metadata`` (``relayrl.tinker.checkpoints``): checked before
anything is written, kept in meta.json, listed as the SDK's ``Checkpoint.user_metadata``
(through the SDK: tests/integration/test_tinker_saves.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from relayrl.tinker.checkpoints import CheckpointError, CheckpointPath, CheckpointStore


def _fill(d: Path) -> None:
    (d / "w.bin").write_bytes(b"x")


def test_user_metadata_is_kept_and_listed(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    store.write(CheckpointPath("m", "weights", "a"), _fill, {"rank": 4}, {"k": "v"})
    store.write(CheckpointPath("m", "sampler_weights", "b"), _fill, {"rank": 4})
    listed = {c["checkpoint_id"]: c["user_metadata"] for c in store.list("m")}
    assert listed == {"weights/a": {"k": "v"}, "sampler_weights/b": None}
    _, meta = store.read(CheckpointPath("m", "weights", "a"))
    assert meta["rank"] == 4 and meta["checkpoint_user_metadata"] == {"k": "v"}


@pytest.mark.parametrize("bad", [{"k": 1}, {1: "v"}, ["k"], "k=v"])
def test_user_metadata_that_is_not_strings_to_strings_writes_nothing(
    tmp_path: Path, bad: object
) -> None:
    store = CheckpointStore(tmp_path)
    path = CheckpointPath("m", "weights", "a")
    with pytest.raises(CheckpointError, match="user_metadata must map strings to strings"):
        store.write(path, _fill, {}, bad)
    assert not store.dir_of(path).exists() and store.list("m") == []
