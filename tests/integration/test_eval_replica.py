"""Issue 43, item 5: ``eval.replica: separate``: in ``schedule=async`` the held-out evaluation
runs beside training on an engine of its own holding a snapshot of the actor's weights at the
version the evaluation started at (``relayrl.controller.eval_replica``)."""

from __future__ import annotations

import json

import pytest

from helpers import SMALL_STEP, run_config
from relayrl.cluster.local import build_local_roles
from relayrl.controller.evaluate import held_out_metrics
from relayrl.controller.trainer import train
from relayrl.model import build_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("evalrep") / "m", hidden_size=32, seed=1)


def _records(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_separate_replica_evaluates_exactly_the_version_it_started_at(tiny, tmp_path):
    """Every token of each evaluation is of the step it started at (version_min ==
    version_max == at_step; on the shared engine an interrupting update may move them), every
    step trained, and the final evaluation (the shared engine, after training) still runs."""
    cfg = run_config(
        tiny,
        tmp_path / "run",
        *SMALL_STEP,
        "train.steps=6",
        "schedule=async",
        "train.eval_every=2",
        "eval.replica=separate",
    )
    out = train(cfg, lambda a, c: build_local_roles(cfg, a, c))
    recs = _records(tmp_path / "run")
    assert len([r for r in recs if "failures/samples" in r]) == 6
    beside = [r for r in recs if "eval/at_step" in r]
    assert beside and {r["eval/at_step"] for r in beside} <= {2.0, 4.0}, recs
    for r in beside:
        assert r["eval/version_min"] == r["eval/version_max"] == r["eval/at_step"], r
        assert r["step"] >= r["eval/at_step"] and 0 <= r["eval/pass_rate"] <= 1
    assert out["eval_after"] is not None


def test_replica_gives_the_evaluation_of_the_trained_weights(tiny, tmp_path):
    """The replica, built beside the run's roles (the initial weights), is loaded as version 2
    after a sync run's 2 steps: its weights are then the actor's (they were not before), and
    it gives the same greedy held-out metrics as the run's own engine (version 2 after its
    last sync)."""
    import torch

    from relayrl.controller.eval_replica import EvalReplica
    from relayrl.data.prompts import PromptSource

    cfg = run_config(
        tiny,
        tmp_path / "r",
        *SMALL_STEP,
        "train.steps=2",
        "eval.greedy=true",
        "reward.fn=tiny_runs:varied_reward",  # a signal: the weights move
    )
    box = {}

    def build(a, c):
        box["roles"] = roles = build_local_roles(cfg, a, c)
        box["replica"] = EvalReplica(cfg, roles)
        return roles

    train(cfg, build)
    roles, replica = box["roles"], box["replica"]
    actor = roles.actor.state_dict()

    def same() -> bool:
        mine = replica.engine.model.state_dict()
        return all(torch.equal(mine[k], v) for k, v in actor.items())

    assert replica.engine.version == 0 and not same()  # the initial weights
    replica.load(2)
    assert replica.engine.version == 2 and same()
    prompts = PromptSource(cfg.data, roles.tokenizer, cfg.seed).eval_set()[:16]
    stop = [roles.tokenizer.eos_token_id]
    args = (roles.reward, prompts, cfg.rollout.max_tokens, stop, cfg.eval, cfg.reward.fn)
    mine = held_out_metrics(replica.engine, *args)
    theirs = held_out_metrics(roles.rollout, *args)
    assert mine["eval/version_min"] == mine["eval/version_max"] == 2
    for k in ("eval/pass_rate", "eval/reward_mean", "eval/n"):
        assert mine[k] == theirs[k], (k, mine, theirs)
