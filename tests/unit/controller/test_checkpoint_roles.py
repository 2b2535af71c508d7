"""``role_state`` / ``load_role_state`` (controller/checkpoint.py): a replicated role's entry is
its train state; a sharded checkpoint resumed without FSDP2 is a one-line error naming it."""

from __future__ import annotations

import pytest
import torch

from relayrl.controller.checkpoint import SHARDED_KEY, load_role_state, role_state
from relayrl.model import build_tiny_model
from relayrl.workers.build import build_actor
from scale_helpers import random_experience, scale_config


def test_replicated_role_round_trips_and_refuses_a_sharded_entry(tmp_path):
    model = build_tiny_model(tmp_path / "m", hidden_size=16)
    actor = build_actor(scale_config(model), str(model))
    actor.update(random_experience(model))
    entry, writer = role_state(actor, "actor")
    assert writer is None and SHARDED_KEY not in entry
    fresh = build_actor(scale_config(model), str(model))
    load_role_state(fresh, entry, tmp_path)
    assert fresh.scheduler.state_dict() == actor.scheduler.state_dict()
    state = fresh.optimizer.state_dict()["state"]
    want = actor.optimizer.state_dict()["state"]
    assert state.keys() == want.keys()
    assert all(torch.equal(state[k]["exp_avg"], want[k]["exp_avg"]) for k in state)
    with pytest.raises(ValueError, match="sharded_actor is a sharded .FSDP2. checkpoint"):
        load_role_state(fresh, {SHARDED_KEY: "sharded_actor"}, tmp_path)
