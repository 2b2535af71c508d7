"""relayrl's Tinker service driven by the real ``tinker`` SDK over HTTP on 127.0.0.1.

Tiny local models; the SDK's own ``ServiceClient`` / ``TrainingClient`` / ``SamplingClient``,
unchanged, pointed at ``relayrl.tinker.server.TinkerServer``.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from helpers import TEST_SEED  # noqa: E402
from relayrl.model import build_tiny_model  # noqa: E402
from relayrl.tinker.server import TinkerServer  # noqa: E402
from relayrl.tinker.service import TinkerService  # noqa: E402

KEY = "tml-relayrl-test"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Path, TinkerServer]]:
    root = tmp_path_factory.mktemp("tinker")
    base = build_tiny_model(root / "base", hidden_size=32, max_position_embeddings=64)
    server = TinkerServer(TinkerService([base], root / "state", seed=0))
    url = server.start()
    client = tinker.ServiceClient(base_url=url, api_key=KEY)
    yield client, base, server
    client.close("success").result(timeout=60)  # ends the session: its heartbeats stop
    server.stop()


def _datum(tokens: list[int], **inputs: list[float] | list[int]) -> Any:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], **inputs},
    )


def _forward_logprobs(tc: Any, data: list[Any]) -> list[np.ndarray]:
    out = tc.forward(data, "cross_entropy").result()
    return [o["logprobs"].to_numpy() for o in out.loss_fn_outputs]


def test_capabilities_info_and_tokenizer(served: Any) -> None:
    client, base, server = served
    caps = tinker.RestClient(base_url=server.base_url(), api_key=KEY)
    caps = caps.get_server_capabilities().result()
    assert [m.model_name for m in caps.supported_models] == [str(base.resolve())]
    assert caps.supported_models[0].max_context_length == 64
    tc = client.create_lora_training_client(base_model=str(base), rank=4).result()
    info = tc.get_info()
    assert info.is_lora and info.lora_rank == 4
    tok = tc.get_tokenizer()
    assert tok.decode(tok.encode("12+3=15")) == "12+3=15"


def test_builtin_loss_values_through_the_sdk(served: Any) -> None:
    """Each built-in loss's ``loss:sum`` equals its formula applied to the logprobs the
    service returns (numpy, by hand)."""
    client, base, _ = served
    tc = client.create_lora_training_client(base_model=str(base), rank=4, seed=1).result()
    tok = tc.get_tokenizer()
    toks = tok.encode("7+8=15")
    n = len(toks) - 1
    rng = np.random.default_rng(0)
    q = (-rng.uniform(0.5, 4.0, n)).tolist()
    adv = rng.normal(size=n).tolist()
    data = [_datum(toks, logprobs=q, advantages=adv)]
    lp = _forward_logprobs(tc, [_datum(toks)])[0].astype(np.float64)
    qa, aa = np.array(q), np.array(adv)
    r = np.exp(lp - qa)
    expected = {
        "importance_sampling": -(r * aa).sum(),
        "ppo": -np.minimum(r * aa, np.clip(r, 0.8, 1.2) * aa).sum(),
        "cispo": -(np.clip(r, 0.8, 1.2) * lp * aa).sum(),
        "dro": -(lp * aa - 0.5 * 0.05 * (lp - qa) ** 2).sum(),
    }
    for name, value in expected.items():
        got = tc.forward(data, name).result().metrics["loss:sum"]
        assert got == pytest.approx(value, rel=1e-4, abs=1e-4), name
    w = rng.uniform(0, 1, n).tolist()
    got = tc.forward([_datum(toks, weights=w)], "cross_entropy").result().metrics["loss:sum"]
    assert got == pytest.approx(-(np.array(w) * lp).sum(), rel=1e-5)


def test_gradients_accumulate_until_optim_step(served: Any) -> None:
    """Two training clients on one base (separate adapters, same seed): forward_backward on
    d1 then d2 before one optim_step trains exactly what one call on [d1, d2] trains; a
    forward-only call adds nothing; the custom-loss path (two passes) trains as well."""
    client, base, _ = served
    a = client.create_lora_training_client(base_model=str(base), rank=4, seed=7).result()
    b = client.create_lora_training_client(base_model=str(base), rank=4, seed=7).result()
    tok = a.get_tokenizer()
    d1, d2 = _datum(tok.encode("1+2=3")), _datum(tok.encode("40+5=45"))
    adam = types.AdamParams(learning_rate=0.05)
    a.forward_backward([d1], "cross_entropy").result()
    a.forward([d2], "cross_entropy").result()
    a.forward_backward([d2], "cross_entropy").result()
    a.optim_step(adam).result()
    b.forward_backward([d1, d2], "cross_entropy").result()
    b.optim_step(adam).result()
    la, lb = _forward_logprobs(a, [d1, d2]), _forward_logprobs(b, [d1, d2])
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_allclose(x, y, atol=1e-5)
    before = _forward_logprobs(a, [d1])[0].sum()

    def custom(data: list[Any], logprobs: list[Any]) -> tuple[Any, dict[str, float]]:
        loss = -sum(lp.sum() for lp in logprobs)
        return loss, {"custom": 1.0}

    res = a.forward_backward_custom([d1], custom).result()
    assert res.metrics["custom"] == 1.0
    assert res.metrics["loss:sum"] == pytest.approx(-before, rel=1e-4)
    a.optim_step(adam).result()
    assert _forward_logprobs(a, [d1])[0].sum() > before


def test_sampling_params_and_prompt_logprobs(served: Any) -> None:
    client, base, _ = served
    tc = client.create_lora_training_client(base_model=str(base), rank=4).result()
    tok = tc.get_tokenizer()
    sampler = client.create_sampling_client(base_model=str(base)).result()
    prompt = types.ModelInput.from_ints(tok.encode("3+4="))
    seeded = types.SamplingParams(max_tokens=6, temperature=1.0, seed=5, stop=[])
    r1 = sampler.sample(prompt, 3, seeded).result()
    r2 = sampler.sample(prompt, 3, seeded).result()
    assert [s.tokens for s in r1.sequences] == [s.tokens for s in r2.sequences]
    assert all(len(s.tokens) == 6 and s.stop_reason == "length" for s in r1.sequences)
    assert all(len(s.logprobs) == 6 for s in r1.sequences)
    text = tok.decode(r1.sequences[0].tokens)
    stop = text[2:4]
    cut = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=6, seed=5, stop=stop))
    seq = cut.result().sequences[0]
    assert tok.decode(seq.tokens).endswith(stop) and seq.stop_reason == "stop"
    # the trainer's recompute (LoRA B = 0 at init: the base model) = the sampler's logprobs
    full = tok.encode("3+4=") + r1.sequences[0].tokens
    lp = _forward_logprobs(tc, [_datum(full)])[0]
    np.testing.assert_allclose(lp[-6:], r1.sequences[0].logprobs, atol=1e-4)
    plp = sampler.compute_logprobs(types.ModelInput.from_ints(full)).result()
    assert plp[0] is None
    np.testing.assert_allclose(plp[1:], lp, atol=1e-4)


def test_user_errors_arrive_as_the_sdks_errors(served: Any) -> None:
    client, base, server = served
    with pytest.raises(tinker.RequestFailedError, match="unknown base model"):
        client.create_lora_training_client(base_model="no-such-model", rank=4).result()
    tc = client.create_lora_training_client(base_model=str(base), rank=4).result()
    too_long = list(range(5, 80))
    with pytest.raises(tinker.RequestFailedError, match="longer than the model's context"):
        tc.forward_backward([_datum(too_long)], "cross_entropy").result()
    bad = _datum([5, 6, 7, 8], weights=[1.0, 1.0])
    with pytest.raises(tinker.RequestFailedError, match="weights"):
        tc.forward_backward([bad], "cross_entropy").result()
    with pytest.raises(tinker.RequestFailedError, match="not supported"):
        tc.forward_backward([_datum([5, 6, 7])], "gspo").result()
    with pytest.raises(tinker.RequestFailedError, match="no checkpoint"):
        client.create_training_client_from_state(f"tinker://{tc.model_id}/weights/nil").result()
    sampler = client.create_sampling_client(base_model=str(base)).result()
    with pytest.raises(tinker.RequestFailedError, match="context"):
        sampler.sample(types.ModelInput.from_ints(too_long), 1, types.SamplingParams()).result()
    server.service.unload_model(tc.model_id)  # no SDK call unloads a model: the service's own
    with pytest.raises(tinker.RequestFailedError, match="unknown model_id"):
        tc.forward_backward([_datum([5, 6, 7])], "cross_entropy").result()


def test_old_unnamed_samplers_expire_named_ones_reload(served: Any) -> None:
    client, base, server = served
    tc = client.create_lora_training_client(base_model=str(base), rank=4).result()
    prompt, params = types.ModelInput.from_ints([5, 6, 7]), types.SamplingParams(max_tokens=2)
    named = tc.create_sampling_client(tc.save_weights_for_sampler("keep").result().path)
    named = named.result()
    samplers = [
        tc.save_weights_and_get_sampling_client().result()
        for _ in range(server.service.keep_samplers + 1)
    ]
    with pytest.raises(tinker.RequestFailedError, match="expired"):
        samplers[0].sample(prompt, 1, params).result()
    assert len(samplers[-1].sample(prompt, 1, params).result().sequences) == 1
    assert len(named.sample(prompt, 1, params).result().sequences) == 1


def test_an_overloaded_service_queues_every_request(served: Any) -> None:
    client, base, _ = served
    sampler = client.create_sampling_client(base_model=str(base)).result()
    params = types.SamplingParams(max_tokens=4, seed=1)
    futures = [
        sampler.sample(types.ModelInput.from_ints([5, 6, i + 5]), 2, params) for i in range(40)
    ]
    assert all(len(f.result().sequences) == 2 for f in futures)


def test_zstd_bodies_and_chunked_requests(tmp_path: Path) -> None:
    """The SDK compresses forward_backward bodies when told to, and splits a call into
    several requests (``fwdbwd_max_chunk_len``): the result is the unsplit call's."""
    base = build_tiny_model(tmp_path / "base", hidden_size=32)
    flags = {"proto_compress_fwdbwd": True, "fwdbwd_max_chunk_len": 2}
    with TinkerServer(TinkerService([base], tmp_path / "state"), client_config=flags) as server:
        with tinker.ServiceClient(base_url=server.base_url(), api_key=KEY) as client:
            tc = client.create_lora_training_client(base_model=str(base), rank=4).result()
            data = [_datum([5 + i, 6, 7, 8 + i]) for i in range(5)]
            out = tc.forward(data, "cross_entropy").result()
            assert len(out.loss_fn_outputs) == 5
            whole = sum(float(o["logprobs"].to_numpy().sum()) for o in out.loss_fn_outputs)
            assert out.metrics["loss:sum"] == pytest.approx(-whole, rel=1e-5)


def test_a_closed_client_ends_its_session_and_its_heartbeats(tmp_path: Path) -> None:
    """``ServiceClient.close`` (here: leaving its ``with``) finishes the session on the server;
    a heartbeat for a finished session answers 410, on which the SDK stops its heartbeat loop
    (it warns about failed heartbeats every 10 s otherwise, for as long as the process lives)."""
    import httpx

    base = build_tiny_model(tmp_path / "base", hidden_size=32)
    with TinkerServer(TinkerService([base], tmp_path / "state")) as server:
        url, headers = server.base_url(), {"X-API-Key": KEY}
        with tinker.ServiceClient(base_url=url, api_key=KEY) as client:
            client.create_lora_training_client(base_model=str(base), rank=4).result()
        assert len(server._finished) == 1  # the SDK's session, finished by close

        def beat(sid: str) -> int:
            body = {"session_id": sid, "type": "session_heartbeat"}
            r = httpx.post(f"{url}/api/v1/session_heartbeat", json=body, headers=headers)
            return r.status_code

        (ended,) = server._finished
        assert beat(ended) == 410
        made = httpx.post(f"{url}/api/v1/create_session", json={}, headers=headers)
        sid = made.json()["session_id"]
        assert beat(sid) == 200
        body = {"reason": {"type": "success"}, "detail": None}
        httpx.post(f"{url}/api/v1/sessions/{sid}/finish", json=body, headers=headers)
        assert beat(sid) == 410


def _seed(step: int, a: int, b: int) -> int:
    """A sampling seed per (step, problem): the samples do not depend on the order in which
    the concurrent requests reach the service (unseeded ones draw from its generator in
    arrival order, which a busy machine reorders)."""
    return 100_000 * (step + 1) + 1_000 * a + 100 * b


@pytest.mark.learning
def test_sl_then_rl_through_the_sdk(tmp_path: Path, outcome: Any) -> None:
    """SL (cross_entropy) then RL (group sampling, group-mean advantages, importance_sampling)
    on one-digit addition, full-parameter training of a tiny Llama. Cross-entropy falls; the
    sampled reward on all 25 problems rises by > 0.05 (seeded samples, the same at any load;
    seeds 0-2 under the avx2 / default / avx512 kernels: rises 0.10 / 0.11 / 0.10,
    0.21 / 0.32 / 0.11, 0.36 / 0.24 / 0.34; min 0.0975); the sampler's
    logprobs equal the trainer's recompute within fp32 tolerance (max gap <= 2e-6)."""
    seed = TEST_SEED
    base = build_tiny_model(tmp_path / "base", hidden_size=64, seed=seed)
    with TinkerServer(TinkerService([base], tmp_path / "state", seed=seed)) as server:
        with tinker.ServiceClient(base_url=server.base_url(), api_key=KEY) as client:
            tc = client.create_lora_training_client(base_model=str(base), rank=0).result()
            tok = tc.get_tokenizer()
            eos = tok.eos_token_id
            problems = [(a, b) for a in range(5) for b in range(5)]
            rng = random.Random(seed)
            sl_losses = []
            for _ in range(150):
                data, tokens = [], 0
                for a, b in rng.sample(problems, 8):
                    prompt = tok.encode(f"{a}+{b}=")
                    full = prompt + tok.encode(str(a + b)) + [eos]
                    w = [0.0] * (len(prompt) - 1) + [1.0] * (len(full) - len(prompt))
                    data.append(_datum(full, weights=w))
                    tokens += len(full) - len(prompt)
                fb = tc.forward_backward(data, "cross_entropy")
                tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
                sl_losses.append(fb.result().metrics["loss:sum"] / tokens)
            assert np.mean(sl_losses[-10:]) < 0.5 * np.mean(sl_losses[:3])

            def reward(a: int, b: int, seq: Any) -> float:
                return float(tok.decode([t for t in seq.tokens if t != eos]) == str(a + b))

            def evaluate() -> float:
                sampler = tc.save_weights_and_get_sampling_client().result()
                futs = [
                    (
                        a,
                        b,
                        sampler.sample(
                            types.ModelInput.from_ints(tok.encode(f"{a}+{b}=")),
                            32,
                            # the same seeds before and after (common random numbers)
                            types.SamplingParams(
                                max_tokens=3, temperature=1.0, seed=_seed(-1, a, b)
                            ),
                        ),
                    )
                    for a, b in problems
                ]
                return float(
                    np.mean([reward(a, b, s) for a, b, f in futs for s in f.result().sequences])
                )

            before = evaluate()
            max_gap = 0.0
            for step in range(40):
                sampler = tc.save_weights_and_get_sampling_client().result()
                futs = [
                    (
                        a,
                        b,
                        sampler.sample(
                            types.ModelInput.from_ints(tok.encode(f"{a}+{b}=")),
                            8,
                            types.SamplingParams(
                                max_tokens=3, temperature=1.0, seed=_seed(step, a, b)
                            ),
                        ),
                    )
                    for a, b in problems
                ]
                data = []
                for a, b, fut in futs:
                    prompt = tok.encode(f"{a}+{b}=")
                    seqs = fut.result().sequences
                    rewards = [reward(a, b, s) for s in seqs]
                    for s, r in zip(seqs, rewards, strict=True):
                        pad = [0.0] * (len(prompt) - 1)
                        adv = pad + [r - float(np.mean(rewards))] * len(s.tokens)
                        data.append(
                            _datum(
                                prompt + s.tokens, logprobs=pad + list(s.logprobs), advantages=adv
                            )
                        )
                fb = tc.forward_backward(data, "importance_sampling")
                tc.optim_step(types.AdamParams(learning_rate=3e-3)).result()
                if step == 0:  # on-policy: the trainer's logprobs are the sampler's
                    for d, out in zip(data, fb.result().loss_fn_outputs, strict=True):
                        q = np.array(d.loss_fn_inputs["logprobs"].data)
                        k = int(np.count_nonzero(q))
                        lp = out["logprobs"].to_numpy()
                        max_gap = max(max_gap, float(np.abs(lp[-k:] - q[-k:]).max()) if k else 0.0)
            after = evaluate()
    outcome(reward_before=before, reward_after=after, logprob_gap=max_gap)
    assert max_gap < 1e-4
    assert after > before + 0.05, (before, after)


SERVE = [sys.executable, "-m", "relayrl.cli", "tinker-serve"]


def _start_cli(base: Path, state: Path) -> tuple[subprocess.Popen[str], str]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2] / "src")}
    proc = subprocess.Popen(
        [*SERVE, str(base), "--port", "0", "--state-dir", str(state), "--threads", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + 120
    for line in proc.stdout:
        if "relayrl tinker-serve: http://" in line:
            return proc, line.split()[2]
        assert time.monotonic() < deadline, "tinker-serve did not start"
    raise AssertionError(f"tinker-serve exited: {proc.wait()}")


def test_save_state_survives_a_killed_service(tmp_path: Path) -> None:
    """save_state, SIGKILL the service (the CLI), start a new one on the same state dir:
    create_training_client_from_state_with_optimizer has identical weights, and its next step
    (Adam moments restored) lands where the killed service's next step landed."""
    base = build_tiny_model(tmp_path / "base", hidden_size=32)
    proc, url = _start_cli(base, tmp_path / "state")
    try:
        with tinker.ServiceClient(base_url=url, api_key=KEY) as client:
            tc = client.create_lora_training_client(
                base_model=str(base), rank=4, seed=3, user_metadata={"purpose": "restart test"}
            ).result()
            tok = tc.get_tokenizer()
            d = _datum(tok.encode("12+30=42"))
            adam = types.AdamParams(learning_rate=0.02)
            for _ in range(3):
                tc.forward_backward([d], "cross_entropy")
                tc.optim_step(adam).result()
            path = tc.save_state("three").result().path
            saved = _forward_logprobs(tc, [d])[0]
            tc.forward_backward([d], "cross_entropy")
            tc.optim_step(adam).result()
            stepped = _forward_logprobs(tc, [d])[0]
            rest = tinker.RestClient(base_url=url, api_key=KEY)
            listed = rest.list_checkpoints(tc.model_id).result()
            assert [c.tinker_path for c in listed.checkpoints] == [path]
            run = rest.get_training_run(tc.model_id).result()
            assert run.lora_rank == 4 and run.user_metadata == {"purpose": "restart test"}
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with TinkerServer(TinkerService([base], tmp_path / "state")) as server:
        with tinker.ServiceClient(base_url=server.base_url(), api_key=KEY) as client:
            tc2 = client.create_training_client_from_state_with_optimizer(path).result()
            rest = tinker.RestClient(base_url=server.base_url(), api_key=KEY)
            assert rest.get_training_run(tc.model_id).result().base_model == str(base.resolve())
            np.testing.assert_array_equal(_forward_logprobs(tc2, [d])[0], saved)
            tc2.forward_backward([d], "cross_entropy")
            tc2.optim_step(adam).result()
            np.testing.assert_allclose(_forward_logprobs(tc2, [d])[0], stepped, atol=1e-6)
