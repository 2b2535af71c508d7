"""The reward service with real worker processes: async submit/poll, timeouts, crashes, bad
return values, import errors, batched model scorers, back-pressure, mixing and logging.

The reward functions below are module-level so that worker processes can import them as
``test_reward_service:NAME``.
"""

from __future__ import annotations

import os
import queue
import time
from concurrent.futures import wait
from dataclasses import dataclass, field
from typing import Any

import pytest

from relayrl.config import RewardConfig
from relayrl.reward import (
    RewardMix,
    RewardService,
    RewardSpec,
    RewardSpecError,
    ScoreResult,
    ServiceClosed,
    batch_reward_stats,
    build_reward_service,
    service_enabled,
    zscore_by_domain,
)

M = "test_reward_service"


# ------------------------------------------------------------------ reward fns for the workers
def slow(prompt: str, completion: str, sample: dict) -> float:
    time.sleep(float(sample.get("sleep", 0.05)))
    return 1.0


def crash(prompt: str, completion: str, sample: dict) -> float:
    os._exit(3)


def not_a_number(prompt: str, completion: str, sample: dict) -> str:
    return "yes"


def boom(prompt: str, completion: str, sample: dict) -> float:
    raise RuntimeError("boom")


def with_reason(prompt: str, completion: str, sample: dict) -> dict:
    return {"chars": float(len(completion)), "score": 0.5, "reason": "measured"}


def worker_pid(prompt: str, completion: str, sample: dict) -> float:
    return float(os.getpid())


class CountingScorer:
    """A batched 'model' scorer that records its batch sizes."""

    def __init__(self, value: float = 2.0, fail_on: str | None = None):
        self.value = value
        self.fail_on = fail_on
        self.batches: list[int] = []

    def score_batch(self, prompts, completions, samples):
        self.batches.append(len(prompts))
        if self.fail_on is not None and self.fail_on in completions:
            raise RuntimeError("model exploded")
        return [{"score": self.value, "len": float(len(c))} for c in completions]


@dataclass
class FakeSample:
    """Quacks like ``relayrl.rollout.Sample`` for the service (response ids are chars)."""

    response_ids: list[int]
    metadata: dict[str, Any] = field(default_factory=dict)
    finish_reason: str = "eos"


class CharTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def sample(text: str, **meta: Any) -> FakeSample:
    return FakeSample([ord(c) for c in text], {"prompt": "q", **meta})


# ------------------------------------------------------------------ tests
def test_inline_service_scores_and_records_on_sample() -> None:
    svc = RewardService(
        RewardMix(["math", {"fn": "format", "weight": 0.5}]), tokenizer=CharTokenizer()
    )
    good = sample("<think>2+2</think><answer>\\boxed{4}</answer>", answer="4")
    bad = sample("five", answer="4")
    r_good, r_bad = svc.score_batch([good, bad])
    assert r_good.score == 1.5 and r_good.outcome == 1.0 and r_good.components["format"] == 1.0
    assert r_bad.score == 0.0 and r_bad.outcome == 0.0 and not r_bad.failed
    assert good.metadata["reward"]["score"] == 1.5
    assert good.metadata["reward"]["components"]["math"] == 1.0
    assert svc.poll() == []  # score_batch hands results back directly
    fut = svc.submit(good)
    assert fut.done() and fut.result().score == 1.5
    assert [s for s, _ in svc.poll()] == [good]
    svc.close()
    with pytest.raises(ServiceClosed):
        svc.submit(good)


def test_reward_fns_see_length_and_finish_reason() -> None:
    svc = RewardService(
        RewardMix([{"fn": "overlong", "kwargs": {"max_length": 10, "cache_length": 4}}]),
        tokenizer=CharTokenizer(),
    )
    r = svc.score_batch([sample("x" * 8), sample("x" * 4), sample("x" * 12)])
    assert [x.score for x in r] == [-0.5, 0.0, -1.0]


def test_pool_scores_in_parallel_and_async() -> None:
    mix = RewardMix([f"{M}:slow"])
    with RewardService(mix, num_workers=2, timeout_s=10, tokenizer=CharTokenizer()) as svc:
        svc.score_batch([sample("warm")] * 2)  # workers up
        t0 = time.perf_counter()
        futures = [svc.submit(sample(f"s{i}", sleep=0.4)) for i in range(4)]
        assert time.perf_counter() - t0 < 0.2  # submit never waits for scoring
        done, _ = wait(futures, timeout=10)
        elapsed = time.perf_counter() - t0
        assert len(done) == 4 and all(f.result().score == 1.0 for f in futures)
        assert elapsed < 1.4, elapsed  # 4 x 0.4 s on 2 workers: ~0.8 s, not 1.6 s
        polled = svc.poll()
        assert len(polled) == 4 and all(r.latency_s > 0.35 for _, r in polled)
        st = svc.stats()
        assert st["reward_service/completed"] == 6 and st["reward_service/in_flight"] == 0


def test_work_is_spread_over_worker_processes() -> None:
    with RewardService(RewardMix([f"{M}:worker_pid"]), num_workers=2) as svc:
        futs = [svc.submit_text("q", "c", {}) for _ in range(40)]
        pids = {f.result().score for f in futs}
    assert float(os.getpid()) not in pids and 1 <= len(pids) <= 2


def test_timeout_becomes_failure_and_worker_is_replaced() -> None:
    tok = CharTokenizer()
    with RewardService(
        RewardMix([f"{M}:slow"]), num_workers=1, timeout_s=0.5, tokenizer=tok
    ) as svc:
        s = sample("x", sleep=30)
        t0 = time.perf_counter()
        r = svc.submit(s).result(timeout=10)
        assert time.perf_counter() - t0 < 5
        assert r.failed and r.score == 0.0 and "timeout" in r.error
        assert s.metadata["reward"]["error"].startswith("timeout")
        # the replacement worker serves the next call
        assert svc.submit(sample("y", sleep=0.01)).result(timeout=10).score == 1.0
        st = svc.stats()
        assert st["reward_service/timeouts"] == 1 and st["reward_service/worker_restarts"] == 1


def test_crashing_worker_becomes_failure() -> None:
    mix = RewardMix([f"{M}:crash"], failure_score=-1.0)
    with RewardService(mix, num_workers=1, timeout_s=10, failure_score=-1.0) as svc:
        r = svc.submit_text("q", "c", {}).result(timeout=20)
        assert r.failed and r.score == -1.0 and "died" in r.error
        r2 = svc.submit_text("q", "c", {}).result(timeout=20)  # replaced again
        assert r2.failed


@pytest.mark.parametrize("num_workers", [0, 1])
def test_non_number_and_exception_fail_only_their_component(num_workers: int) -> None:
    mix = RewardMix(
        [
            {"fn": "exact_match", "weight": 1.0},
            {"fn": f"{M}:not_a_number", "name": "nan_fn", "weight": 1.0},
            {"fn": f"{M}:boom", "weight": 1.0},
        ]
    )
    with RewardService(mix, num_workers=num_workers, timeout_s=10) as svc:
        r = svc.submit_text("q", "8", {"answer": "8"}).result(timeout=20)
    assert r.score == 1.0 and r.outcome == 1.0 and r.components["exact_match"] == 1.0
    assert "nan_fn: TypeError" in r.error and "must be a number" in r.error
    assert "boom: RuntimeError: boom" in r.error


def test_reason_and_extra_components_are_recorded() -> None:
    with RewardService(RewardMix([f"{M}:with_reason"]), num_workers=1) as svc:
        r = svc.submit_text("q", "abc", {}).result(timeout=20)
    assert r.score == 0.5 and r.components["with_reason/chars"] == 3.0
    assert r.reason == "with_reason: measured" and not r.failed


def test_bad_specs_are_clear_errors() -> None:
    with pytest.raises(RewardSpecError, match="cannot import module 'no_such_module_xyz'"):
        RewardMix(["no_such_module_xyz:fn"])
    with pytest.raises(RewardSpecError, match="has no attribute 'nope'"):
        RewardMix([f"{M}:nope"])
    with pytest.raises(RewardSpecError, match="unknown reward function"):
        RewardMix(["not_registered"])
    with pytest.raises(RewardSpecError, match="max_length"):
        RewardMix([{"fn": "overlong", "kwargs": {"cache_length": 4}}])
    with pytest.raises(RewardSpecError, match="duplicate"):
        RewardMix(["math", "math"])
    with pytest.raises(RewardSpecError, match="outcome"):
        RewardMix(["math"], outcome="format")
    with pytest.raises(ValueError, match="needs a reward"):
        RewardService(None)


def test_undecodable_sample_is_a_recorded_failure() -> None:
    svc = RewardService("exact_match")  # no tokenizer: cannot decode token ids
    s = FakeSample([1, 2, 3], {"prompt": "q"})
    r = svc.submit(s).result()
    assert r.failed and "cannot decode" in r.error and s.metadata["reward"]["error"] == r.error


def test_model_scorers_are_batched_and_mixed() -> None:
    scorer = CountingScorer(value=2.0)
    with RewardService(
        RewardMix(["exact_match"]),
        num_workers=1,
        model_scorers=[("rm", scorer, 0.5)],
        model_batch_size=8,
        model_max_wait_s=0.2,
        tokenizer=CharTokenizer(),
    ) as svc:
        futs = [svc.submit(sample("8", answer="8")) for _ in range(8)]
        results = [f.result(timeout=20) for f in futs]
    assert scorer.batches == [8]  # one forward pass for the eight
    r = results[0]
    assert r.score == 1.0 + 0.5 * 2.0 and r.components["rm"] == 2.0 and r.components["rm/len"] == 1
    assert r.outcome == 1.0  # the rule part stays the verifiable outcome


def test_model_scorer_inline_batch_and_failure() -> None:
    scorer = CountingScorer(value=1.0, fail_on="bad")
    svc = RewardService(scorer, tokenizer=CharTokenizer())  # a bare scorer: model only
    results = svc.score_batch([sample("a"), sample("b"), sample("c")])
    assert scorer.batches == [3] and [r.score for r in results] == [1.0, 1.0, 1.0]
    results = svc.score_batch([sample("ok"), sample("bad")])
    assert all(r.failed and "model exploded" in r.error for r in results)


def test_max_pending_applies_back_pressure() -> None:
    with RewardService(RewardMix([f"{M}:slow"]), num_workers=1, max_pending=2) as svc:
        svc.submit_text("q", "a", {"sleep": 0.5})
        svc.submit_text("q", "b", {"sleep": 0.5})
        with pytest.raises(queue.Full):
            svc.submit_text("q", "c", {"sleep": 0.0}, block=False)
        t0 = time.perf_counter()
        svc.submit_text("q", "d", {"sleep": 0.0}, timeout=5).result(timeout=10)
        assert time.perf_counter() - t0 > 0.2  # waited for a slot


def test_close_fails_what_is_in_flight() -> None:
    svc = RewardService(RewardMix([f"{M}:slow"]), num_workers=1, timeout_s=60)
    futs = [svc.submit_text("q", str(i), {"sleep": 5}) for i in range(3)]
    svc.close()
    results = [f.result(timeout=20) for f in futs]
    assert all(r.failed and "closed" in r.error for r in results)


def test_mixing_weights_and_zscores() -> None:
    mix = RewardMix(
        [RewardSpec("exact_match", 2.0), RewardSpec("format", 0.5, {"tags": ["answer"]})]
    )
    r = mix("q", "<answer>8</answer>", {"answer": "<answer>8</answer>"})
    assert r.score == 2.0 * 1.0 + 0.5 * 1.0 and r.outcome == 1.0
    z = zscore_by_domain([1.0, 3.0, 10.0, 10.0, 5.0], ["a", "a", "b", "b", "c"])
    assert z[:2] == pytest.approx([-1.0, 1.0], abs=1e-5) and z[2:] == [0.0, 0.0, 0.0]
    assert zscore_by_domain([1.0, 2.0, 3.0]) == pytest.approx([-1.2247, 0.0, 1.2247], abs=1e-4)
    with pytest.raises(ValueError):
        zscore_by_domain([1.0], ["a", "b"])
    results = [
        ScoreResult(1.0, {"math": 1.0, "format": 0.0, "score": 1.0}, 1.0),
        ScoreResult(0.5, {"math": 0.0, "format": 1.0, "score": 0.5}, 0.0, error="x"),
    ]
    st = batch_reward_stats(results, ["a", "b"])
    assert st["reward/math"] == 0.5 and st["reward/format"] == 0.5
    assert st["reward/outcome"] == 0.5 and st["reward/failed_frac"] == 0.5
    assert st["reward/domain/a/score"] == 1.0 and st["reward/domain/b/score"] == 0.5


def test_build_from_config() -> None:
    cfg = RewardConfig()
    assert not service_enabled(cfg) and build_reward_service(cfg) is None
    cfg = RewardConfig.model_validate(
        {
            "service": {
                "functions": [
                    {"fn": "math", "weight": 1.0},
                    {"fn": "format", "weight": 0.2, "kwargs": {"tags": ["answer"]}},
                ],
                "outcome": "math",
                "normalize": "domain_zscore",
            }
        }
    )
    svc = build_reward_service(cfg)
    assert svc is not None and svc.mix is not None and svc.mix.names == ["math", "format"]
    r = svc.submit_text("q", "<answer>\\boxed{3}</answer>", {"answer": "3"}).result()
    assert r.score == pytest.approx(1.2)


def test_reward_worker_uses_the_service() -> None:
    from relayrl.workers.reward import RewardWorker

    svc = RewardService(RewardMix(["exact_match"]), tokenizer=CharTokenizer())
    worker = RewardWorker(None, CharTokenizer(), service=svc, normalize="domain_zscore")
    samples = [sample("8", answer="8", domain="a"), sample("7", answer="8", domain="a")]
    scores, stats = worker.score(samples)
    assert scores.tolist() == pytest.approx([1.0, -1.0], abs=1e-5)
    assert stats["reward/exact_match"] == 0.5 and stats["reward/outcome"] == 0.5
    assert samples[0].metadata["reward"]["outcome"] == 1.0


def test_unpicklable_function_with_workers_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="must be picklable"):
        RewardService(lambda p, c, s: 1.0, num_workers=1)
    svc = RewardService(lambda p, c, s: 1.0)  # inline: any callable
    assert svc.submit_text("q", "c", {}).result().score == 1.0


def test_inline_batch_larger_than_max_pending() -> None:
    scorer = CountingScorer()
    svc = RewardService(
        "exact_match", model_scorers=[scorer], max_pending=2, tokenizer=CharTokenizer()
    )
    results = svc.score_batch([sample("8", answer="8") for _ in range(5)])
    assert [r.score for r in results] == [3.0] * 5 and scorer.batches == [5]
    assert svc.submit(sample("8", answer="8")).result().score == 3.0  # slots all released
    assert svc.submit(sample("8", answer="8")).result().score == 3.0
    assert svc.submit(sample("8", answer="8")).result().score == 3.0


def test_training_run_with_reward_service_config(tmp_path) -> None:
    """The config path end to end: a weighted mixture scored in a worker process, every
    component logged, domain z-scores."""
    import json

    from helpers import run_config
    from relayrl.cluster.local import build_local_roles
    from relayrl.controller.trainer import train
    from relayrl.model import build_tiny_model

    model = build_tiny_model(tmp_path / "base", hidden_size=32)
    cfg = run_config(
        model,
        tmp_path / "run",
        "train.steps=1",
        "algo.prompts_per_step=4",
        "algo.group_size=2",
        "data.eval_size=4",
        "reward.service.functions=[{fn: arithmetic}, {fn: format, weight: 0.1, name: fmt}]",
        "reward.service.num_workers=1",
        "reward.service.normalize=domain_zscore",
    )
    roles = build_local_roles(cfg, str(model), None)
    assert roles.reward.service is not None and roles.reward.service.num_workers == 1
    roles.reward.service.close()
    train(cfg, lambda a, c: build_local_roles(cfg, a, c))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in rows if "reward_mean" in r)
    for key in ("reward/arithmetic", "reward/fmt", "reward/outcome", "reward/failed_frac"):
        assert key in step, key
    assert step["reward/failed_frac"] == 0.0
