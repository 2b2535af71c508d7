"""A request the engine refuses is an infrastructure failure (``engine``) in every schedule.

The engine in its own process (``cluster.engine_process``) reports a request its engine refuses
(``InvalidRequestError``: here a bad sampling parameter) through ``rejected()``, never as a
sample. The async rollout controller turns each into the ``'abort'`` sample with ``error`` set
that ``generate`` hands back: generated again up to ``failures.retries`` times, then left out of
the batch, never scored. Before it read ``rejected()``, the refused request's group never
completed and the trainer waited for it until ``failures.stall_s``. The engine process's
``generate`` hands a refused request back as that sample too (it used to wait forever).
"""

from __future__ import annotations

import dataclasses
import json

import pytest

import relayrl.controller.rollout_controller as rollout_controller
from helpers import SMALL_STEP, run_config
from relayrl.cluster.engine_process import EngineProcess, EngineSpec
from relayrl.cluster.local import build_local_roles
from relayrl.controller.failures import FailureLog, infra_cause
from relayrl.controller.trainer import train
from relayrl.model import build_tiny_model, load_causal_lm, load_tokenizer
from relayrl.rollout import GenerationRequest, SamplingParams

REFUSED = "top_p must be in (0, 1], got 0.0"  # the engine's InvalidRequestError


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("refused") / "m", hidden_size=32, seed=1)


def _refuse_last_of_even_groups(group_requests):
    """``group_requests`` with request k = 3 of every even group given ``top_p = 0``, which
    the engine refuses (its retries too: the same request again)."""

    def requests(prompt, cfg, step, index, group_id, stop_ids):
        out = group_requests(prompt, cfg, step, index, group_id, stop_ids)
        if group_id % 2 == 0:
            out[3] = dataclasses.replace(
                out[3], params=dataclasses.replace(out[3].params, top_p=0.0)
            )
        return out

    return requests


@pytest.mark.parametrize("schedule", ["async", "overlap"])
def test_a_request_the_engine_process_refuses_is_retried_then_left_out(
    tiny, tmp_path, monkeypatch, schedule
):
    """B = 4 groups of G = 4 per step; request 3 of groups 0, 2, 4, 6 is refused by the real
    engine worker, each time it is sent. Both steps train (no stall at 20 s), each leaves out
    exactly its 2 refused samples (cause ``engine``, the engine's error, no reward) and
    trains the 14 others; the refused ones were generated again (``failures.retries=1``)."""
    monkeypatch.setattr(
        rollout_controller,
        "group_requests",
        _refuse_last_of_even_groups(rollout_controller.group_requests),
    )
    admitted = []
    admit = FailureLog.admit

    def spy(self, samples, scores, grouped=True):
        kept, kept_scores = admit(self, samples, scores, grouped)
        admitted.append((list(samples), kept))
        return kept, kept_scores

    monkeypatch.setattr(FailureLog, "admit", spy)
    run_dir = tmp_path / "run"
    cfg = run_config(
        tiny,
        run_dir,
        *SMALL_STEP,
        "train.steps=2",
        f"schedule={schedule}",
        "async.eta=1",
        "failures.retries=1",
        "failures.stall_s=20",
    )
    train(cfg, lambda a, c: build_local_roles(cfg, a, c))

    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "failures/samples" in r]
    assert [r["failures/samples"] for r in steps] == [16, 16]
    assert [r["failures/infra/engine"] for r in steps] == [2, 2]
    assert [r["failures/infra"] for r in steps] == [2, 2]
    assert sum(r["failures/retried"] for r in steps) >= 4  # groups 0, 2, 4, 6 at least
    assert len(admitted) == 2
    for step, (samples, kept) in enumerate(admitted):
        out = [s for s in samples if not any(s is k for k in kept)]
        assert sorted((s.group_id, s.metadata["sample_index"]) for s in out) == [
            (4 * step, 3),
            (4 * step + 2, 3),
        ]
        for s in out:
            assert s.finish_reason == "abort" and s.response_ids == []
            assert s.error == f"the engine refused the request: {REFUSED}"
            assert s.metadata["failure"]["cause"] == "engine"
            assert "reward" not in s.metadata  # never scored
        assert len(kept) == 14 and all(infra_cause(s) is None for s in kept)


def test_engine_process_generate_hands_a_refused_request_back_as_an_abort_sample(tiny):
    """``generate`` on the engine process, a refused request between two good ones: its
    ``'abort'`` sample with the engine's error in its place (as the engine's own
    ``generate``), the others generated; nothing is left for ``rejected()``."""
    model, tok = load_causal_lm(tiny), load_tokenizer(tiny)
    spec = EngineSpec(
        model_path=str(tiny),
        dtype="float32",
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        max_slots=2,
        threads=1,
        version=0,
        urgent_steps=0,
    )
    ids = tok.encode("12+3=", add_special_tokens=False)
    params = [
        SamplingParams(max_tokens=3, seed=i, top_p=p, ignore_eos=True)
        for i, p in enumerate([1.0, 0.0, 1.0])
    ]
    requests = [GenerationRequest(ids, p, 7, {"i": i}) for i, p in enumerate(params)]
    with EngineProcess(spec, model.state_dict()) as proc:
        samples = proc.generate(requests)
        assert [s.metadata for s in samples] == [{"i": 0}, {"i": 1}, {"i": 2}]
        assert [s.finish_reason for s in samples] == ["length", "abort", "length"]
        assert samples[1].error == REFUSED and samples[1].response_ids == []
        assert (samples[1].prompt_ids, samples[1].group_id) == (ids, 7)
        assert infra_cause(samples[1]) == "engine"
        assert proc.rejected() == []
