"""Issue 43: a lost Ray replica's resubmitted requests carry the infrastructure cause.

Units: ``note_retry`` (the tag), ``FailureLog`` counting it per step as ``failures/retried/
<cause>`` (a continuous series once seen), ``fresh_request`` dropping it, and the Ray client's
``lost_on_replica`` (the tag a request in flight on a dead replica is resubmitted with). The
real kill is ``tests/integration/test_ray_backend.py::
test_killed_rollout_replica_is_restarted_without_losing_or_duplicating``, which checks that
exactly the resubmitted samples carry it.
"""

from __future__ import annotations

import pytest
import torch

from relayrl.config.failures import FailuresConfig
from relayrl.controller.failures import (
    FailureLog,
    InfraBudgetExceeded,
    fresh_request,
    note_retry,
)
from relayrl.rollout import GenerationRequest, SamplingParams
from relayrl.rollout.types import Sample


def _sample(group: int, metadata: dict) -> Sample:
    return Sample(0, [1, 2], [3, 4], [-0.1, -0.2], [0, 0], "stop", group, dict(metadata))


def test_note_retry_appends_the_cause():
    meta = {"prompt": "1+1=", "sample_index": 2}
    once = note_retry(meta, "replica_lost", "rollout replica 0 died\n(RayActorError)")
    twice = note_retry(once, "replica_lost", "rollout replica 1 died")
    assert meta == {"prompt": "1+1=", "sample_index": 2}  # not changed in place
    assert once["retried"] == [
        {"cause": "replica_lost", "error": "rollout replica 0 died (RayActorError)"}
    ]
    assert [r["error"] for r in twice["retried"]] == [
        "rollout replica 0 died (RayActorError)",
        "rollout replica 1 died",
    ]
    req = GenerationRequest([1], SamplingParams(), 0, twice)
    assert "retried" not in fresh_request(req).metadata


def test_retried_samples_train_and_are_counted_per_step():
    """Step 1: 4 samples; the first resubmitted once after a lost replica, the second twice,
    the fourth a reward_fn failure. 3 train (the resubmitted ones too); the count is per
    resubmission: failures/retried/replica_lost = 1 + 2 = 3. Step 2: none, the series reads 0."""
    lost = note_retry({}, "replica_lost", "rollout replica 0 died")
    lost_twice = note_retry(lost, "replica_lost", "rollout replica 1 died")
    bad = {"reward": {"error": "f: ValueError: boom"}}
    samples = [_sample(0, lost), _sample(0, lost_twice), _sample(0, {}), _sample(0, bad)]
    log = FailureLog()
    kept, _ = log.admit(samples, torch.tensor([1.0, 0.0, 1.0, 0.0]))
    assert len(kept) == 3 and kept[0].metadata["retried"][0]["cause"] == "replica_lost"
    m = log.metrics()
    assert m["failures/retried/replica_lost"] == 3
    assert m["failures/infra"] == 1 and m["failures/infra/reward_fn"] == 1
    assert "failures/infra/replica_lost" not in m  # retried, not left out
    log.admit([_sample(1, {}), _sample(1, {})], torch.zeros(2))
    assert log.metrics()["failures/retried/replica_lost"] == 0


def test_a_request_lost_on_a_dead_replica_is_tagged():
    pytest.importorskip("ray")
    from ray.exceptions import RayActorError

    from relayrl.cluster.ray_rollout import lost_on_replica
    from relayrl.cluster.ray_workers import TICKET

    req = GenerationRequest([5, 6], SamplingParams(seed=3), 7, {"sample_index": 1, TICKET: 4})
    again = lost_on_replica(req, 9, 0, RayActorError())
    assert (again.prompt_ids, again.params, again.group_id) == ([5, 6], req.params, 7)
    assert again.metadata[TICKET] == 9 and again.metadata["sample_index"] == 1
    assert again.metadata["retried"] == [
        {
            "cause": "replica_lost",
            "error": "rollout replica 0 died (RayActorError) with the request in flight",
        }
    ]
    assert req.metadata[TICKET] == 4 and "retried" not in req.metadata


def test_replica_losses_are_charged_to_the_budget():
    """Each lost attempt (``metadata["retried"]``) is charged to the budget in the order it
    happened, before the sample's own outcome: samples lost twice each make the attempts
    F F S F F S ... (2 of 3 failed), past max_rate 0.5 over a window of 6 once it fills; the
    one line names replica_lost and its last error. The same samples in a log with a larger
    window train."""
    lost = note_retry(
        note_retry({}, "replica_lost", "rollout replica 0 died"),
        "replica_lost",
        "rollout replica 1 died (RayActorError)",
    )
    samples = [_sample(0, lost), _sample(0, lost)]
    roomy = FailureLog(FailuresConfig(max_rate=0.5, window=64))
    kept, _ = roomy.admit(samples, torch.ones(2))
    assert len(kept) == 2 and list(roomy.recent) == [True, True, False] * 2
    tight = FailureLog(FailuresConfig(max_rate=0.5, window=6))
    with pytest.raises(InfraBudgetExceeded) as info:
        tight.admit(samples, torch.ones(2))
    msg = str(info.value)
    assert "\n" not in msg and "4 of the last 6 samples failed (failures.max_rate=0.5)" in msg
    assert "mostly replica_lost (4 of 4)" in msg
    assert msg.endswith("last error: rollout replica 1 died (RayActorError)")


def test_replica_losses_in_a_row_stop_the_run():
    """A sample lost three times: 3 failed attempts in a row reach max_consecutive=3; one lost
    twice (then delivered) does not."""
    twice = note_retry(note_retry({}, "replica_lost", "a"), "replica_lost", "b")
    log = FailureLog(FailuresConfig(max_consecutive=3))
    log.admit([_sample(0, twice), _sample(0, twice)], torch.ones(2))
    thrice = note_retry(twice, "replica_lost", "rollout replica 0 died again")
    with pytest.raises(InfraBudgetExceeded, match=r"3 samples in a row failed.*replica_lost"):
        log.admit([_sample(1, thrice), _sample(1, {})], torch.ones(2))
