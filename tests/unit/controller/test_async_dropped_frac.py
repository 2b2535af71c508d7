"""The async schedule's ``dynamic/dropped_frac`` is per step, as the sync schedule's: the groups
dropped since the previous step over the groups completed since then (it was the run's
cumulative fraction)."""

from __future__ import annotations

from types import SimpleNamespace

from relayrl.config import RunConfig, load_config
from relayrl.controller.schedules import AsyncSchedule
from relayrl.telemetry.timeline import Timeline


class _Poller:
    """Enough of a ``PollingBackend`` to build the schedule (nothing is generated)."""

    version, max_slots, max_model_len = 0, 2, None

    def submit(self, request): ...
    def submit_many(self, requests): ...
    def poll(self, timeout=0.0):
        return []

    def rejected(self):
        return []

    def generate(self, requests):
        return []

    def update_weights(self, state_dict, version, interrupt=True): ...
    def prioritize(self, group_ids): ...
    def report(self): ...
    def close(self): ...


def test_dropped_frac_counts_the_groups_since_the_previous_step():
    cfg = load_config(RunConfig, None, ["schedule=async", "data.dynamic_sampling.enabled=true"])
    roles = SimpleNamespace(rollout=_Poller(), reward=None)
    schedule = AsyncSchedule(roles, cfg, source=None, stop_ids=[], timeline=Timeline())
    c = schedule.controller
    # (dropped, completed) so far, after each step -> that step's fraction, by hand:
    # 3 of 10; (5 - 3) of (18 - 10) = 2/8; none completed; (9 - 5) of (22 - 18) = 4/4
    steps = [((3, 10), 0.3), ((5, 18), 0.25), ((5, 18), 0.0), ((9, 22), 1.0)]
    for (dropped, completed), frac in steps:
        c.groups_dropped, c.groups_completed = dropped, completed
        assert schedule._dropped_frac() == frac  # cumulative: 0.3, 0.278, 0.278, 0.409
