"""The held-out evaluation between steps is watched by the stall watchdog (``failures.stall_s``,
``controller.watchdog``) as the step's rollout is: real sync runs of the tiny model whose
engine's ``generate`` is wrapped for the evaluation's calls only (all their requests greedy;
training samples). One hangs on an Event that is never set: the run ends in one line naming
the evaluation and its step, the step it evaluated checkpointed, the checkpoint before it
untouched, and ``--resume`` finishes the run. One generates its answers one at a time and waits,
before each next one, until the watchdog saw more than ``stall_s`` without a mark and took the
engine's moved counters for progress: slow, progressing, not stopped.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from pathlib import Path

import pytest

from helpers import run_config
from relayrl.cluster.local import build_local_roles
from relayrl.controller import watchdog
from relayrl.controller.checkpoint import load_trainer_state
from relayrl.controller.faults import RunFault
from relayrl.controller.trainer import train
from relayrl.model import build_tiny_model

BOUND_S = 120
"""A wait that only a broken test reaches (it then fails); never a synchronisation."""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("evalwd") / "m", hidden_size=32, seed=1)


def _records(run_dir: Path) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "step" in rec:
            out.setdefault(int(rec["step"]), {}).update(rec)
    return out


def _digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _is_eval(requests) -> bool:
    return bool(requests) and all(r.params.greedy for r in requests)


def _config(tiny: Path, run_dir: Path, steps: int, save_every: int, stall_s: float, *more: str):
    return run_config(
        tiny,
        run_dir,
        "rollout.max_tokens=4",
        "algo.prompts_per_step=2",
        "algo.group_size=2",
        f"train.steps={steps}",
        "train.eval_every=1",
        f"train.save_every={save_every}",
        f"failures.stall_s={stall_s}",
        *more,
    )


@pytest.mark.parametrize(
    ("save_every", "steps", "hang_at"),
    [(1, 3, 2), (2, 4, 3)],
    ids=["step-saved-by-cadence", "step-saved-on-the-stall"],
)
def test_a_hung_evaluation_between_steps_ends_the_run_in_one_line(
    tiny, tmp_path, save_every, steps, hang_at
):
    """The evaluation at step ``hang_at`` hangs in the engine's generate: the run stops with
    ``held-out evaluation at step N stalled: ...``; step N (trained, logged without its
    evaluation) is checkpointed, by the cadence or on the stall, the checkpoint written before
    the evaluation keeps its bytes, and a resume trains the rest."""
    run_dir = tmp_path / "run"
    cfg = _config(tiny, run_dir, steps, save_every, 2, "data.eval_size=2")
    never = threading.Event()  # never set: the evaluation's call hangs until the process ends
    before: dict[str, dict[str, str]] = {}
    evals = [0]

    def roles_with_a_hung_eval(actor_path, critic_path):
        roles = build_local_roles(cfg, actor_path, critic_path)
        real = roles.rollout.generate

        def generate(requests):
            if _is_eval(requests):
                evals[0] += 1
                if evals[0] == hang_at + 1:  # the first evaluation is step 0's
                    ckpts = run_dir / "checkpoints"
                    before.update({p.name: _digest(p) for p in ckpts.glob("step_*")})
                    never.wait(BOUND_S)
                    return []  # reached only when the watchdog did not stop the run
            return real(requests)

        roles.rollout.generate = generate
        return roles

    with pytest.raises(RunFault) as e:
        train(cfg, roles_with_a_hung_eval)
    msg = str(e.value)
    ckpt = run_dir / "checkpoints" / f"step_{hang_at:06d}"
    assert "\n" not in msg, msg
    assert msg.startswith(f"held-out evaluation at step {hang_at} stalled: no progress for "), msg
    assert "(failures.stall_s=2); stuck: RolloutEngine generating 2 requests (for " in msg, msg
    if save_every == 1:  # the cadence wrote it before the stall ended the run
        assert msg.endswith(f"; the newest intact checkpoint is {ckpt}; continue with --resume")
    else:
        assert msg.endswith(f"; checkpoint {ckpt} written; continue with --resume"), msg
    prior = f"step_{hang_at - 1:06d}"
    assert list(before) == [prior]  # the checkpoint written before the evaluation ...
    assert _digest(run_dir / "checkpoints" / prior) == before[prior]  # ... is untouched
    assert load_trainer_state(ckpt)["step"] == hang_at
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == ckpt.name
    records = _records(run_dir)
    assert "eval/pass_rate" in records[hang_at - 1]
    assert "reward_mean" in records[hang_at] and "eval/pass_rate" not in records[hang_at]

    out = train(cfg, lambda a, c: build_local_roles(cfg, a, c), resume=True)
    assert out["eval_after"] is not None
    assert load_trainer_state(run_dir / "checkpoints" / f"step_{steps:06d}")["step"] == steps


def test_a_slow_evaluation_that_progresses_is_not_stopped(tiny, tmp_path, monkeypatch):
    """The evaluation at step 1 generates its 3 answers one call each: the first once the
    watchdog read its phase's baseline, each next one once the watchdog, past ``stall_s``
    without a mark, read the engine's moved counters as progress (a touch). Each gap is longer
    than ``stall_s``; the run finishes and logs the evaluation. (Without the watchdog's probe
    it stops: no touch ever comes.)"""
    run_dir = tmp_path / "run"
    cfg = _config(tiny, run_dir, 2, 0, 2, "data.eval_size=3")
    touched, probed = threading.Event(), threading.Event()
    touches = [0]
    real_touch, real_mark = watchdog.Progress.touch, watchdog.Progress.mark

    def touch(self):
        real_touch(self)
        touches[0] += 1
        touched.set()

    def mark(self, what):
        probed.clear()  # the next read of the engine's counters is this phase's baseline
        real_mark(self, what)

    monkeypatch.setattr(watchdog.Progress, "touch", touch)
    monkeypatch.setattr(watchdog.Progress, "mark", mark)
    evals = [0]

    def roles_with_a_slow_eval(actor_path, critic_path):
        roles = build_local_roles(cfg, actor_path, critic_path)
        real_generate, real_report = roles.rollout.generate, roles.rollout.report

        def report():
            out = real_report()
            probed.set()  # after the read: the next answer moves what the baseline holds
            return out

        def generate(requests):
            if not _is_eval(requests):
                return real_generate(requests)
            evals[0] += 1
            if evals[0] != 2:  # step 0's and the final evaluation: as they are
                return real_generate(requests)
            if not probed.wait(BOUND_S):  # the phase's baseline, read after its mark
                raise RuntimeError("the watchdog never read the engine's counters")
            touches[0] = 0
            out = []
            for i, request in enumerate(requests):
                if i:
                    touched.clear()
                    if not touched.wait(BOUND_S):
                        raise RuntimeError("the watchdog never took the progress")
                out += real_generate([request])
            return out

        roles.rollout.generate = generate
        roles.rollout.report = report
        return roles

    out = train(cfg, roles_with_a_slow_eval)
    assert evals[0] == 3 and touches[0] >= 2  # two gaps, each past stall_s, each progress
    records = _records(run_dir)
    assert records[1]["eval/n"] == 3 and "eval/pass_rate" in records[1]
    assert out["eval_after"] is not None


def test_a_hung_background_evaluation_on_its_replica_ends_the_run_in_one_line(
    tiny, tmp_path, monkeypatch
):
    """``schedule=async``, ``eval.replica=separate``: the replica's generate hangs in the
    evaluation of step 2 (never released). Training goes on beside it; the trainer finds the
    stall where it looks at the evaluation (a step's end, or the wait after the last step) and
    the run ends in one line naming it; the checkpoint it names is intact and the one written
    before the evaluation started keeps its bytes."""
    from relayrl.controller import trainer
    from relayrl.controller.eval_replica import EvalReplica

    run_dir = tmp_path / "run"
    cfg = _config(
        tiny,
        run_dir,
        4,
        1,
        2,
        "data.eval_size=2",
        "schedule=async",
        "eval.replica=separate",
        "train.eval_every=2",  # one beside training: step 2's
        "train.keep_checkpoints=10",  # step 1 is kept: compared below
    )
    never = threading.Event()
    before: dict[str, dict[str, str]] = {}

    class HungReplica(EvalReplica):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            real = self.engine.generate

            def generate(requests):
                if self.engine.version == 2:
                    before["step_000001"] = _digest(run_dir / "checkpoints" / "step_000001")
                    never.wait(BOUND_S)
                    return []
                return real(requests)

            self.engine.generate = generate

    monkeypatch.setattr(trainer, "EvalReplica", HungReplica)
    with pytest.raises(RunFault) as e:
        train(cfg, lambda a, c: build_local_roles(cfg, a, c))
    msg = str(e.value)
    assert "\n" not in msg, msg
    assert msg.startswith("held-out evaluation at step 2 (in the background) stalled: "), msg
    assert "(failures.stall_s=2); stuck: RolloutEngine generating 2 requests (for " in msg, msg
    named = re.search(r"(?:checkpoint|the newest intact checkpoint is) (\S+step_\d+)", msg)
    assert named, msg
    ckpt = Path(named.group(1))
    assert load_trainer_state(ckpt)["step"] >= 2
    assert _digest(run_dir / "checkpoints" / "step_000001") == before["step_000001"]


def test_every_background_evaluation_that_ran_is_logged(tiny, tmp_path):
    """``schedule=async``, an evaluation due after each of steps 1-3: each one either ran and
    is logged (``eval/at_step``) or was skipped (``eval/skipped``, cumulative), so the two add
    up to 3. (A finished evaluation is collected before the next one starts: when the start
    came first, one that finished between two steps was dropped unlogged.)"""
    run_dir = tmp_path / "run"
    cfg = _config(tiny, run_dir, 4, 0, 600, "data.eval_size=2", "schedule=async")
    train(cfg, lambda a, c: build_local_roles(cfg, a, c))
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    ran = [r["eval/at_step"] for r in lines if "eval/at_step" in r]
    skipped = max([r.get("eval/skipped", 0.0) for r in lines])
    assert len(ran) == len(set(ran)) and len(ran) + skipped == 3, (ran, skipped)
