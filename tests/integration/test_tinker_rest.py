"""The SDK's ``RestClient`` calls for runs, checkpoints and sessions, through the real ``tinker``
SDK (and its ``tinker`` CLI) against a ``TinkerServer`` (relayrl.tinker.rest). Tiny local models;
one server per module.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from relayrl.model import build_tiny_model  # noqa: E402
from relayrl.tinker import rest as tinker_rest  # noqa: E402
from relayrl.tinker.checkpoints import CheckpointError, CheckpointPath, CheckpointStore  # noqa: E402
from relayrl.tinker.server import TinkerServer  # noqa: E402
from relayrl.tinker.service import TinkerService  # noqa: E402

KEY = "tml-relayrl-test"
OLD_RUN = "session-earlier:train:0"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any, Path, Any]]:
    """A client, a RestClient, the base model, the server. The state dir already holds a
    checkpoint of OLD_RUN, saved by an earlier service (rank 2, attention only)."""
    root = tmp_path_factory.mktemp("tinker_rest")
    base = build_tiny_model(root / "base", hidden_size=32, max_position_embeddings=64)
    earlier = TinkerService([base], root / "state", seed=0)
    lora = {"rank": 2, "train_mlp": False, "train_unembed": False}
    earlier.create_model(OLD_RUN, str(base.resolve()), lora, user_metadata={"who": "earlier"})
    earlier.save_state(OLD_RUN, "old")
    server = TinkerServer(TinkerService([base], root / "state", seed=0))
    url = server.start()
    with tinker.ServiceClient(base_url=url, api_key=KEY) as client:
        yield client, tinker.RestClient(base_url=url, api_key=KEY), base, server
    server.stop()


def test_list_training_runs_pages_over_live_runs_and_runs_on_disk(served: Any) -> None:
    client, rest, base, _ = served
    tcs = [client.create_lora_training_client(base_model=str(base), rank=4).result()]
    tcs.append(client.create_lora_training_client(base_model=str(base), rank=8).result())
    everything = rest.list_training_runs(limit=100).result()
    ids = [r.training_run_id for r in everything.training_runs]
    assert everything.cursor.total_count == len(ids) and ids == sorted(ids)
    assert {OLD_RUN, tcs[0].model_id, tcs[1].model_id} <= set(ids)
    by_id = {r.training_run_id: r for r in everything.training_runs}
    assert by_id[OLD_RUN].lora_rank == 2 and by_id[OLD_RUN].user_metadata == {"who": "earlier"}
    assert by_id[OLD_RUN].last_checkpoint.tinker_path == f"tinker://{OLD_RUN}/weights/old"
    assert by_id[tcs[1].model_id].lora_rank == 8 and by_id[tcs[1].model_id].is_lora
    pages = [rest.list_training_runs(limit=2, offset=o).result() for o in range(0, len(ids), 2)]
    assert [r.training_run_id for p in pages for r in p.training_runs] == ids
    assert [(p.cursor.offset, p.cursor.limit) for p in pages][:2] == [(0, 2), (2, 2)]
    assert rest.list_training_runs(offset=len(ids)).result().training_runs == []
    with pytest.raises(tinker.BadRequestError, match="limit must be >= 1"):
        rest.list_training_runs(limit=0).result()
    with pytest.raises(tinker.BadRequestError, match="offset must be >= 0"):
        rest.list_training_runs(offset=-1).result()
    with pytest.raises(tinker.BadRequestError, match="no projects"):
        rest.list_training_runs(project_id="p").result()


def test_training_run_and_weights_info_by_tinker_path(served: Any) -> None:
    client, rest, base, _ = served
    tc = client.create_lora_training_client(base_model=str(base), rank=4, train_mlp=False)
    tc = tc.result()
    path = tc.save_state("w").result().path
    run = rest.get_training_run_by_tinker_path(path).result()
    assert run.training_run_id == tc.model_id and run.lora_rank == 4
    assert run.last_checkpoint.tinker_path == path
    info = rest.get_weights_info_by_tinker_path(path).result()
    assert info.base_model == str(base.resolve()) and info.is_lora and info.lora_rank == 4
    assert (info.train_attn, info.train_mlp) == (True, False)
    old = rest.get_weights_info_by_tinker_path(f"tinker://{OLD_RUN}/weights/old").result()
    assert (old.lora_rank, old.train_attn, old.train_mlp, old.train_unembed) == (
        2,
        True,
        False,
        False,
    )
    full = client.create_lora_training_client(base_model=str(base), rank=0).result()
    sampler_path = full.save_weights_for_sampler("full").result().path
    info = rest.get_weights_info_by_tinker_path(sampler_path).result()
    assert not info.is_lora and info.lora_rank is None and info.train_mlp is None
    missing = f"tinker://{tc.model_id}/weights/nil"
    with pytest.raises(tinker.NotFoundError, match=f"unknown checkpoint {missing}"):
        rest.get_weights_info_by_tinker_path(missing).result()
    with pytest.raises(tinker.BadRequestError, match="must be tinker://"):
        rest.get_weights_info_by_tinker_path("tinker://x/other/y").result()
    with pytest.raises(tinker.NotFoundError, match="unknown training run"):
        rest.get_training_run_by_tinker_path("tinker://no-run/weights/x").result()


def test_delete_checkpoint_by_id_and_by_tinker_path(served: Any) -> None:
    client, rest, base, server = served
    tc = client.create_lora_training_client(base_model=str(base), rank=4).result()
    kept = tc.save_state("kept").result().path
    gone = tc.save_state("gone").result().path
    sampler_path = tc.save_weights_for_sampler("s").result().path
    on_disk = server.service.store.root / tc.model_id
    named = client.create_sampling_client(model_path=sampler_path).result()
    prompt, params = types.ModelInput.from_ints([5, 6, 7]), types.SamplingParams(max_tokens=2)
    assert len(named.sample(prompt, 1, params).result().sequences) == 1

    rest.delete_checkpoint(tc.model_id, "weights/gone").result()
    rest.delete_checkpoint_from_tinker_path(sampler_path).result()
    listed = rest.list_checkpoints(tc.model_id).result().checkpoints
    assert [c.tinker_path for c in listed] == [kept]
    assert sorted(p.name for p in (on_disk / "weights").iterdir()) == ["kept"]  # nothing aside
    assert list((on_disk / "sampler_weights").iterdir()) == []
    with pytest.raises(tinker.NotFoundError, match=f"unknown checkpoint {gone}"):
        rest.delete_checkpoint_from_tinker_path(gone).result()
    with pytest.raises(tinker.NotFoundError, match="unknown checkpoint"):
        rest.delete_checkpoint("no-such-run", "weights/x").result()
    with pytest.raises(tinker.BadRequestError, match="must be tinker://"):
        rest.delete_checkpoint(tc.model_id, "weights/a/b").result()
    with pytest.raises(tinker.RequestFailedError, match="no checkpoint"):
        client.create_training_client_from_state(gone).result()
    # the sampler on the deleted checkpoint fails once the engine must reload its weights
    base_sampler = client.create_sampling_client(base_model=str(base)).result()
    assert len(base_sampler.sample(prompt, 1, params).result().sequences) == 1
    with pytest.raises(tinker.RequestFailedError, match="no checkpoint"):
        named.sample(prompt, 1, params).result()


def test_a_delete_behind_running_work_answers_and_happens_in_turn(
    served: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker is held by a save; the delete answers without waiting for it (the SDK would
    time out and send it again), and deletes once the save is done."""
    client, rest, base, server = served
    tc = client.create_lora_training_client(base_model=str(base), rank=4).result()
    path = tc.save_state("doomed").result().path
    started, release = threading.Event(), threading.Event()
    save_state = server.service.save_state

    def held_save(model_id: str, name: str | None, **kw: Any) -> dict[str, Any]:
        started.set()
        assert release.wait(60)
        return save_state(model_id, name, **kw)

    monkeypatch.setattr(server.service, "save_state", held_save)
    monkeypatch.setattr(tinker_rest, "WAIT_S", 0.1)
    try:
        held = tc.save_state("later")
        assert started.wait(60)  # the worker is in the save
        rest.delete_checkpoint_from_tinker_path(path).result(timeout=30)
    finally:
        release.set()
    later = held.result()
    tc.save_state("after").result()  # queued after the delete: it has run
    listed = [c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints]
    assert path not in listed and later.path in listed


def test_delete_refuses_directories_outside_the_state_dir(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "state")
    outside = tmp_path / "weights" / "x"  # what tinker://../weights/x names
    outside.mkdir(parents=True)
    (outside / "meta.json").write_text("{}")
    with pytest.raises(CheckpointError, match="unknown checkpoint"):
        store.delete(CheckpointPath("..", "weights", "x"))
    (tmp_path / "state" / "linked").symlink_to(tmp_path)  # tinker://linked/weights/x
    with pytest.raises(CheckpointError, match="unknown checkpoint"):
        store.delete(CheckpointPath("linked", "weights", "x"))
    assert (outside / "meta.json").is_file()


def test_list_user_checkpoints_newest_first_in_pages(served: Any) -> None:
    client, rest, base, _ = served
    tc = client.create_lora_training_client(base_model=str(base), rank=4).result()
    paths = [tc.save_state(f"c{i}").result().path for i in range(3)]
    everything = rest.list_user_checkpoints(limit=1000).result()
    listed = [c.tinker_path for c in everything.checkpoints]
    assert everything.cursor.total_count == len(listed)
    assert f"tinker://{OLD_RUN}/weights/old" in listed
    assert listed.index(paths[2]) < listed.index(paths[1]) < listed.index(paths[0])
    times = [c.time for c in everything.checkpoints]
    assert times == sorted(times, reverse=True)
    pages = [rest.list_user_checkpoints(limit=2, offset=o).result() for o in range(0, 6, 2)]
    assert [c.tinker_path for p in pages for c in p.checkpoints] == listed[:6]
    with pytest.raises(tinker.BadRequestError, match="limit must be an integer"):
        rest.list_user_checkpoints(limit="many").result()  # type: ignore[arg-type]


def test_sessions_list_their_runs_and_samplers(served: Any) -> None:
    client, rest, base, server = served
    with tinker.ServiceClient(
        base_url=server.base_url(), api_key=KEY, user_metadata={"team": "rl"}
    ) as own:
        tc = own.create_lora_training_client(base_model=str(base), rank=4).result()
        sampler = own.create_sampling_client(base_model=str(base)).result()
        unnamed = tc.save_weights_and_get_sampling_client().result()
        sid = tc.model_id.split(":train:")[0]
        assert sid in rest.list_sessions(limit=100).result().sessions
        session = rest.get_session(sid).result()
        assert session.training_run_ids == [tc.model_id]
        assert session.sampler_ids == [
            sampler._sampling_session_id,
            unnamed._sampling_session_id,
        ]
        assert session.user_metadata == {"team": "rl"}
    with pytest.raises(tinker.NotFoundError, match="unknown session"):
        rest.get_session("session-nope").result()


def test_the_tinker_cli_lists_runs_and_checkpoints_and_deletes(served: Any) -> None:
    """``tinker run list``, ``tinker checkpoint list``, ``tinker checkpoint delete -y``: the SDK's
    own CLI (RestClient from TINKER_BASE_URL / TINKER_API_KEY) against the service."""
    client, rest, base, server = served
    tc = client.create_lora_training_client(base_model=str(base), rank=4).result()
    path = tc.save_state("cli").result().path
    env = {**os.environ, "TINKER_API_KEY": KEY, "TINKER_BASE_URL": server.base_url()}
    cli = str(Path(sys.executable).parent / "tinker")
    if not Path(cli).exists():
        pytest.skip("the tinker CLI is not installed next to this python")

    def run(*args: str) -> Any:
        out = subprocess.run(
            [cli, "--format", "json", *args], env=env, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    assert tc.model_id in [r["training_run_id"] for r in run("run", "list", "--limit", "0")["runs"]]
    assert path in [c["tinker_path"] for c in run("checkpoint", "list")["checkpoints"]]
    assert run("checkpoint", "delete", "-y", path) == {"deleted_count": 1, "failed": []}
    assert rest.list_checkpoints(tc.model_id).result().checkpoints == []
