"""Audit of "an infrastructure failure is never training data" (docs/failures.md), breaking
the real components rather than mocks of them.

- a single-turn request the engine aborts (mid-generation, as a server that drops a request
  does) or refuses (a bad request) comes back as an ``'abort'`` sample, scored 0 by the reward
  function: an infrastructure failure (``engine``), left out of the batch and retried, as an
  aborted turn of an episode is;
- ``reward.service.normalize: domain_zscore``: a sample whose reward call failed does not move
  its domain's mean and standard deviation (the survivors' scores are those of a batch without
  it);
- a reward worker killed from outside (SIGKILL by the OS) while it scores is ``reward_worker``;
- an environment whose ``step`` raises in turn 2, after a turn of model tokens, trains none of
  them;
- a reward function that calls ``sys.exit`` on one sample of a group fails that sample only,
  inline as in the reward service (inline, the ``SystemExit`` used to end the run).
"""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch

from relayrl.controller.failures import FailureLog, infra_cause, retry_failed
from relayrl.model import build_tiny_model, load_causal_lm, load_tokenizer
from relayrl.reward import RewardService
from relayrl.rollout import GenerationRequest, RolloutEngine, SamplingParams
from relayrl.rollout.types import Sample
from relayrl.workers.reward import RewardWorker


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("audit") / "m", hidden_size=32, seed=5)
    return load_causal_lm(path).eval(), load_tokenizer(path)


def _engine(model, tok, **kw) -> RolloutEngine:
    return RolloutEngine(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **kw)


def _request(tok, i: int, group: int = 0, max_tokens: int = 8) -> GenerationRequest:
    ids = tok.encode("12+3=", add_special_tokens=False)
    return GenerationRequest(
        ids,
        SamplingParams(max_tokens=max_tokens, seed=100 + i, ignore_eos=True),
        group_id=group,
        metadata={"prompt": "12+3=", "answer": "15", "sample_index": i},
    )


# ---------------------------------------------------------------- engine aborts, single turn


def test_a_single_turn_request_the_engine_aborts_is_not_trained(tiny):
    """Group of 3: two requests finish, one is aborted after 2 of its 8 tokens (the engine's
    ``abort``: what a vLLM server's own ``abort`` / unknown finish reason also maps to). The
    arithmetic reward scores its partial text 0 without an error; the failure log must still
    leave it out (cause ``engine``) and the group's statistics are over the 2 survivors."""
    model, tok = tiny
    engine = _engine(model, tok, max_slots=4)
    ids = [engine.submit(_request(tok, i)) for i in range(3)]
    finished: list[Sample] = []
    while len((engine.progress(ids[2]) or ([],))[0]) < 2:  # waiting until it runs
        finished += engine.step()
    assert engine.abort(ids[2])
    finished += engine.drain()
    samples = sorted(finished, key=lambda s: s.metadata["sample_index"])
    assert [s.finish_reason for s in samples] == ["length", "length", "abort"]
    assert len(samples[2].response_ids) >= 2  # tokens of an interrupted generation
    scores, _ = RewardWorker(_always_one, tok).score(samples)
    assert scores.tolist() == [1.0, 1.0, 1.0]  # a reward that would have trained it
    assert infra_cause(samples[2]) == "engine"
    log = FailureLog()
    kept, kept_scores = log.admit(samples, scores)
    assert kept == samples[:2] and kept_scores.tolist() == [1.0, 1.0]
    m = log.metrics()
    assert m["failures/infra/engine"] == 1 and m["failures/infra"] == 1
    assert samples[2].metadata["failure"]["cause"] == "engine"


def _always_one(prompt: str, completion: str, sample: dict) -> float:
    return 1.0


def test_a_request_the_engine_refuses_is_retried_then_left_out(tiny):
    """``generate`` hands a bad request (a prompt past the context) back as an ``'abort'``
    sample with ``error`` set. It is retried (``failures.retries``) and, still refused, left
    out; the good samples train."""
    model, tok = tiny
    engine = _engine(model, tok, max_slots=4, max_model_len=16)
    bad = GenerationRequest(
        list(range(3, 23)),  # 20 prompt tokens > max_model_len 16
        SamplingParams(max_tokens=4, seed=7),
        group_id=0,
        metadata={"prompt": "x", "sample_index": 2},
    )
    requests = [_request(tok, 0, max_tokens=4), _request(tok, 1, max_tokens=4), bad]
    reward = RewardWorker(_always_one, tok)
    samples = engine.generate(requests)
    assert samples[2].finish_reason == "abort" and samples[2].error
    scores, _ = reward.score(samples)
    samples, scores, retried = retry_failed(engine, reward, requests, samples, scores, retries=2)
    assert retried == 2  # one failed sample, generated again twice
    assert infra_cause(samples[2]) == "engine"
    kept, _ = FailureLog().admit(samples, scores)
    assert kept == samples[:2]


# ---------------------------------------------------------------- reward normalisation


class _Chars:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(96 + i) for i in ids)


def _scored(value: float, domain: str, outage: bool = False) -> Sample:
    meta = {"prompt": "p", "value": value, "domain": domain, "outage": outage}
    return Sample(0, [1, 2], [3, 4], [-0.1, -0.2], [0, 0], "stop", 0, meta)


def test_domain_zscore_is_over_the_samples_that_scored():
    """Domain a: values [1, 0, 1] and a sample whose reward call failed (scored 0); domain b:
    [2, 4]. z = (x - mean_d) / std_d (population std) over the samples that scored: a has
    mean 2/3, std sqrt(2/9) = 0.471405, so z = 0.707107, -1.414214, 0.707107; counting the
    failure's 0 (mean 1/2, std 1/2) would have given 1, -1, 1. b: mean 3, std 1: -1, 1."""
    from failure_helpers import value_or_outage

    svc = RewardService(value_or_outage, num_workers=0, tokenizer=_Chars(), timeout_s=20)
    samples = [
        _scored(1.0, "a"),
        _scored(0.0, "a"),
        _scored(5.0, "a", outage=True),
        _scored(1.0, "a"),
        _scored(2.0, "b"),
        _scored(4.0, "b"),
    ]
    try:
        scores, _ = RewardWorker(None, _Chars(), svc, normalize="domain_zscore").score(samples)
    finally:
        svc.close()
    assert infra_cause(samples[2]) == "reward_fn"
    kept, kept_scores = FailureLog().admit(samples, scores, grouped=False)
    assert samples[2] not in kept
    r = (2 / 9) ** 0.5
    expected = [(1 / 3) / r, (-2 / 3) / r, (1 / 3) / r, -1.0, 1.0]
    torch.testing.assert_close(kept_scores, torch.tensor(expected), atol=1e-5, rtol=0)
    torch.testing.assert_close(
        kept_scores[:3], torch.tensor([0.707107, -1.414214, 0.707107]), atol=1e-5, rtol=0
    )


# ---------------------------------------------------------------- reward worker killed by the OS


def test_a_reward_worker_killed_from_outside_is_an_infra_failure(tmp_path):
    """The OS kills a reward worker (SIGKILL, as the OOM killer does) while it scores: the
    sample is ``reward_worker``, left out, not a 0 that trains; the service replaces the worker."""
    fifo = tmp_path / "pid"
    os.mkfifo(fifo)
    svc = RewardService(
        {"fn": "failure_helpers:reports_pid_then_blocks", "kwargs": {"fifo": str(fifo)}},
        num_workers=1,
        tokenizer=_Chars(),
        timeout_s=60,
    )
    sample = _scored(1.0, "a")
    out: list[torch.Tensor] = []
    try:
        scorer = threading.Thread(
            target=lambda: out.append(RewardWorker(None, _Chars(), svc).score([sample])[0])
        )
        scorer.start()
        with open(fifo) as f:  # blocks until the worker is in the reward call
            pid = int(f.read())
        os.kill(pid, signal.SIGKILL)
        scorer.join(timeout=60)
        restarts = svc.stats()["reward_service/worker_restarts"]
    finally:
        svc.close()
    assert out and out[0].tolist() == [0.0]
    assert infra_cause(sample) == "reward_worker", sample.metadata["reward"]
    assert "exit code -9" in sample.metadata["reward"]["error"]
    assert restarts >= 1
    kept, _ = FailureLog().admit([sample, _scored(1.0, "a")], torch.tensor([0.0, 1.0]), False)
    assert sample not in kept


# ---------------------------------------------------------------- environment fails mid-episode


def test_an_environment_that_raises_in_turn_2_trains_none_of_the_episode(tiny):
    """Two episodes of a group: in one, ``step`` answers turn 1 and raises after turn 2 (a
    backend lost mid-episode); the other finishes. The failed episode's model tokens of both
    turns are never trained (loss mask 0, and the sample is left out as ``env``); it scores 0
    but the survivor's score is untouched."""
    from relayrl.env import FunctionEnvironment, PlainRenderer, StepResult
    from relayrl.env.runner import EpisodeRunner, RunnerLimits
    from relayrl.env.scoring import EpisodeScorer

    model, tok = tiny
    made = {"n": 0}

    def factory():
        made["n"] += 1
        broken = made["n"] == 1

        def reset(row, state):
            state["turn"] = 0
            return [{"role": "user", "content": row["prompt"]}]

        def step(message, state):
            state["turn"] += 1
            if state["turn"] == 2 and broken:
                raise ConnectionError("tool backend: connection reset")
            return StepResult([{"role": "tool", "content": "ok"}], done=state["turn"] == 2)

        return FunctionEnvironment(reset, step)

    limits = RunnerLimits(max_turns=3, max_turn_tokens=4, max_model_len=256, step_timeout_s=10)
    runner = EpisodeRunner(
        _engine(model, tok, max_slots=2), factory, PlainRenderer(tok), limits, concurrency=1
    )
    try:
        samples = runner.generate([_request(tok, 0, max_tokens=4), _request(tok, 1, max_tokens=4)])
    finally:
        runner.close()
    failed, healthy = samples
    assert failed.metadata["env"]["stop_reason"] == "env_error"
    assert failed.metadata["env"]["turns"] == 2 and len(failed.response_ids) >= 8
    assert failed.loss_mask is not None and sum(failed.loss_mask) == 0
    assert healthy.metadata["env"]["stop_reason"] == "env_done"
    scores, _ = EpisodeScorer(RewardWorker(_always_one, tok)).score(samples)
    assert scores.tolist() == [0.0, 1.0]
    assert infra_cause(failed) == "env"
    kept, _ = FailureLog().admit(samples, scores, grouped=False)
    assert kept == [healthy]


# ---------------------------------------------------------------- a reward function that exits


@pytest.mark.parametrize("path", ["inline", "inline_timeout", "service"])
def test_a_reward_fn_that_calls_sys_exit_on_one_sample_fails_that_sample_only(path):
    """``sys.exit`` in the reward function on sample 1 of a group of 3: that sample is a
    ``reward_fn`` failure, left out; the others score 1 and train; the run is not ended. The
    inline path (with and without ``reward.fn_timeout_s``) records it as the service does."""
    from failure_helpers import exits_on_flagged

    samples = [_scored(1.0, "a"), _scored(1.0, "a", outage=True), _scored(1.0, "a")]
    if path == "service":
        svc = RewardService(exits_on_flagged, num_workers=0, tokenizer=_Chars(), timeout_s=20)
        try:
            scores, _ = RewardWorker(None, _Chars(), svc).score(samples)
        finally:
            svc.close()
    else:
        timeout = 20.0 if path == "inline_timeout" else None
        scores, _ = RewardWorker(exits_on_flagged, _Chars(), timeout_s=timeout).score(samples)
    assert scores.tolist() == [1.0, 0.0, 1.0]
    assert infra_cause(samples[1]) == "reward_fn"
    assert "SystemExit" in samples[1].metadata["reward"]["error"]
    kept, kept_scores = FailureLog().admit(samples, scores)
    assert kept == [samples[0], samples[2]] and kept_scores.tolist() == [1.0, 1.0]


# ---------------------------------------------------------------- retries under domain_zscore


def test_domain_zscore_after_a_retry_is_that_of_a_clean_batch(tiny, tmp_path):
    """``rollout_and_score`` with ``domain_zscore``: requests with values [1, 0, 1] in domain a,
    the third's first reward call fails (retried: the same completion, scored 1), and a fourth
    request the engine refuses every time (an ``engine`` failure, its reward call fine, value
    5). The batch's scores are z-scored over the 3 that train, as if scored at once: mean 2/3,
    std sqrt(2/9): 0.707107, -1.414214, 0.707107. Before, the retried sample was z-scored alone
    (0) and the refused one's 5 moved the others."""
    from types import SimpleNamespace

    from failure_helpers import value_outage_once
    from relayrl.controller.algorithms import rollout_and_score

    model, tok = tiny
    engine = _engine(model, tok, max_slots=4, max_model_len=16)
    requests = [_request(tok, i, max_tokens=4) for i in range(3)]
    for req, value in zip(requests, (1.0, 0.0, 1.0), strict=True):
        req.metadata.update(value=value, domain="a")
    requests[2].metadata["outage_once"] = str(tmp_path)  # a key no other test uses
    refused = GenerationRequest(
        list(range(3, 23)),  # 20 prompt tokens > max_model_len 16
        SamplingParams(max_tokens=4, seed=7),
        group_id=0,
        metadata={"prompt": "x", "sample_index": 3, "value": 5.0, "domain": "a"},
    )
    requests.append(refused)
    svc = RewardService(value_outage_once, num_workers=0, tokenizer=tok, timeout_s=20)
    reward = RewardWorker(None, tok, svc, normalize="domain_zscore")
    timer: dict[str, float] = {}
    try:
        roles = SimpleNamespace(rollout=engine, reward=reward)
        samples, scores, _ = rollout_and_score(roles, requests, timer, retries=2)  # type: ignore[arg-type]
    finally:
        svc.close()
    assert timer["failures/retried"] == 3  # the outage once; the refused request twice
    assert infra_cause(samples[2]) is None and infra_cause(samples[3]) == "engine"
    r = (2 / 9) ** 0.5
    torch.testing.assert_close(
        scores[:3], torch.tensor([(1 / 3) / r, (-2 / 3) / r, (1 / 3) / r]), atol=1e-5, rtol=0
    )
    torch.testing.assert_close(
        scores[:3], torch.tensor([0.707107, -1.414214, 0.707107]), atol=1e-5, rtol=0
    )


def test_domain_zscore_after_regenerated_groups_is_over_the_batch_that_trains(tmp_path):
    """The sync schedule regenerates the groups failures left with 1 sample (the draws of
    ``test_failures_regen``: 5 regenerations at step 1, no group dropped) and the reward
    service z-scores (one domain: the arithmetic rows have none). The 16 scores that train
    are the z-scores of their raw scores as one batch: mean 0, population std 1. Before, the
    regenerated groups kept the z-scores of their own sub-batch beside the step's."""
    from helpers import SMALL_STEP, run_config
    from relayrl.cluster.local import build_local_roles
    from relayrl.controller.algorithms import admit
    from relayrl.controller.schedules import SyncSchedule
    from relayrl.data.prompts import PromptSource
    from relayrl.telemetry.timeline import Timeline

    model_dir = build_tiny_model(tmp_path / "m", hidden_size=32, seed=1)
    cfg = run_config(
        model_dir,
        tmp_path / "run",
        *SMALL_STEP,
        "reward.fn=failure_helpers:uneven_fails_on_prompts",
        "reward.service.normalize=domain_zscore",
        "failures.retries=1",
        "failures.regenerate_rounds=2",
    )
    roles = build_local_roles(cfg, str(model_dir), None)
    try:
        tok = roles.tokenizer
        source = PromptSource(cfg.data, tok, cfg.seed)
        schedule = SyncSchedule(roles, cfg, source, [tok.eos_token_id], Timeline())
        samples, scores, _ = schedule.rollout(1)
        kept, kept_scores, _ = admit(roles, cfg, schedule.failures, samples, scores)
        m = schedule.failures.metrics()
    finally:
        roles.close()
    assert m["failures/groups_regenerated"] == 5 and m["failures/infra"] == 0
    assert len(kept) == 16
    raw = torch.tensor([s.metadata["reward"]["score"] for s in kept], dtype=torch.float64)
    assert float(raw.std()) > 0.1  # scores that differ: the normalisation shows
    z = kept_scores.double()
    torch.testing.assert_close(z, (raw - raw.mean()) / raw.std(unbiased=False), atol=1e-4, rtol=0)
    assert abs(float(z.mean())) < 1e-5
    assert abs(float(z.std(unbiased=False)) - 1.0) < 1e-4


# ---------------------------------------------------------------- the sandbox killed from outside


def _code_sample() -> Sample:
    meta = {"prompt": "write add", "tests": ["assert add(1, 2) == 3"]}
    return Sample(0, [1, 2], [3, 4], [-0.1, -0.2], [0, 0], "stop", 0, meta)


class _Text:
    def __init__(self, code: str):
        self.code = code

    def decode(self, ids, skip_special_tokens=True):
        return f"```python\n{self.code}\n```"


def _supervised_mode() -> str:
    from relayrl.reward.sandbox import Sandbox

    mode = Sandbox().mode
    if mode not in ("bwrap", "namespace"):
        pytest.skip(f"sandbox isolation {mode}: the program is its own supervisor")
    return mode


def test_a_sandbox_killed_from_outside_is_an_infra_failure(monkeypatch):
    """The code reward runs a (correct) program; the OS kills the sandbox's supervisor
    process (bubblewrap / unshare: SIGKILL from outside, as the host's OOM killer does) while
    it runs. The sample is a ``sandbox`` infrastructure failure, left out: not a 0 that
    trains as the program's own failure would."""
    import subprocess

    from relayrl.reward import get_reward_fn
    from relayrl.reward.sandbox import run as sandbox_run

    _supervised_mode()
    started = threading.Event()
    procs: list[subprocess.Popen] = []

    class Recorded(subprocess.Popen):  # the real Popen; its pid is told to the test
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            procs.append(self)
            started.set()

    monkeypatch.setattr(sandbox_run.subprocess, "Popen", Recorded)
    code = "import time\ndef add(a, b):\n    return a + b\ntime.sleep(30)"
    sample = _code_sample()
    out: list[torch.Tensor] = []
    scorer = threading.Thread(
        target=lambda: out.append(
            RewardWorker(get_reward_fn("code"), _Text(code)).score([sample])[0]
        )
    )
    scorer.start()
    assert started.wait(30)
    os.kill(procs[0].pid, signal.SIGKILL)
    scorer.join(timeout=60)
    assert out and out[0].tolist() == [0.0]
    assert infra_cause(sample) == "sandbox", sample.metadata["reward"]
    assert "killed from outside the sandbox" in sample.metadata["reward"]["error"]
    kept, _ = FailureLog().admit([sample, _code_sample()], torch.tensor([0.0, 1.0]), False)
    assert sample not in kept


def test_a_program_that_kills_itself_is_a_model_failure():
    """The program SIGKILLs itself (or the OOM killer / a CPU hard limit kills it inside the
    sandbox): its own doing, indistinguishable by exit status from a kill of the program from
    outside. It keeps its 0 and trains (were it left out, a policy could dodge a failing
    score by killing itself)."""
    from relayrl.reward import get_reward_fn

    _supervised_mode()
    code = (
        "import os, signal\ndef add(a, b):\n    return a + b\nos.kill(os.getpid(), signal.SIGKILL)"
    )
    sample = _code_sample()
    scores, _ = RewardWorker(get_reward_fn("code"), _Text(code)).score([sample])
    assert scores.tolist() == [0.0]
    assert infra_cause(sample) is None
    kept, _ = FailureLog().admit([sample], scores, grouped=False)
    assert kept == [sample]
    result = get_reward_fn("code")("write add", _Text(code).decode([]), dict(sample.metadata))
    assert result["score"] == 0.0 and "SIGKILL" in result["reason"]


# ---------------------------------------------------------------- a tool call that times out

SLOW_SERVER = '''
import asyncio

from mcp.server.mcpserver import MCPServer

mcp = MCPServer("slow")


@mcp.tool()
async def lookup(key: str) -> str:
    """Look a key up (its backend never answers)."""
    await asyncio.sleep(60)
    return key


if __name__ == "__main__":
    mcp.run()
'''


def test_an_mcp_tool_call_that_times_out_is_an_environment_failure(tmp_path):
    """A live MCP server whose tool does not answer within its call bound (1 s once started;
    the step's own bound is 60 s): the episode ends ``env_error`` (not a tool error shown to
    the model and trained), its tokens are never trained, the sample is left out (``env``)."""
    pytest.importorskip("mcp")
    import sys

    from qwen_template import ScriptedEngine, qwen_tokenizer
    from relayrl.env import ChatTemplateRenderer
    from relayrl.env.mcp_tools import MCPToolEnvironment
    from relayrl.env.runner import EpisodeRunner, RunnerLimits

    class QuickCalls(MCPToolEnvironment):
        """Starts with the default bound (a busy machine's start-up), then bounds calls at 1 s."""

        async def reset(self, row):
            out = await super().reset(row)
            self.server.timeout_s = 1.0
            return out

    path = tmp_path / "slow.py"
    path.write_text(SLOW_SERVER)
    tok = qwen_tokenizer()
    call = '<tool_call>\n{"name": "lookup", "arguments": {"key": "x"}}\n</tool_call>'
    runner = EpisodeRunner(
        ScriptedEngine(tok, [call, "x"]),
        lambda: QuickCalls([sys.executable, str(path)], call_timeout_s=30),
        ChatTemplateRenderer(tok),
        RunnerLimits(max_turns=3, max_model_len=8192, step_timeout_s=60),
    )
    req = GenerationRequest(
        [1], SamplingParams(max_tokens=100, seed=0), group_id=0, metadata={"prompt": "x"}
    )
    try:
        (s,) = runner.generate([req])
    finally:
        runner.close()
    assert s.metadata["env"]["stop_reason"] == "env_error"
    assert "did not answer in 1 s" in s.metadata["env"]["error"]
    assert s.loss_mask is not None and sum(s.loss_mask) == 0
    assert infra_cause(s) == "env"
    with pytest.raises(Exception, match="no sample of the step is left to train"):
        FailureLog().admit([s], torch.zeros(1), grouped=False)
