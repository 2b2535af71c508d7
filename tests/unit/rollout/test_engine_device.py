"""The engine computes where its model is: no tensor on torch's default device, one device ->
host transfer per forward, the device through the engine process's spec.

On the CPU a tensor made without ``device=`` is a CPU tensor like the model's, so a CPU run
cannot show it; inside ``with torch.device("meta"):`` it lands on meta and the step fails
when it meets the model's CPU tensors. The CUDA tests at the end run only on a GPU machine.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch

from relayrl.cluster.engine_process import (
    EngineSpec,
    build_own_engine,
    check_device,
    shared_weights,
)
from relayrl.rollout import GenerationRequest, RolloutEngine, SamplingParams, sampler
from relayrl.rollout.transfer import to_host
from rollout_helpers import EOS, PAD, random_prompts, tiny_model

CUDA = torch.cuda.is_available()
PROMPTS = random_prompts([3, 9, 1, 14, 6, 2, 11], seed=5)  # made outside any device context


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.nn.Module]:
    root = tmp_path_factory.mktemp("device-models")
    return {
        "llama": tiny_model(root, "llama"),
        "llama-1": tiny_model(root, "llama", seed=1),
        "gpt2": tiny_model(root, "gpt2"),
        "gpt2-1": tiny_model(root, "gpt2", seed=1),
    }


def _params(i: int) -> SamplingParams:
    kinds = [
        SamplingParams(greedy=True, max_tokens=10),
        SamplingParams(temperature=0.8, max_tokens=12, seed=i),
        SamplingParams(temperature=1.2, top_k=6, top_p=0.9, max_tokens=14, seed=i),
    ]
    return kinds[i % 3]


def _workload(engine: RolloutEngine, other: dict[str, torch.Tensor]) -> list[tuple]:
    """generate, then a run across an interrupting update, a non-interrupting one (the old
    model is copied), an abort and a streamed update; every sample's tokens, logprobs,
    versions and finish reason."""
    base = {k: v.clone() for k, v in engine.model.state_dict().items()}
    prompts = PROMPTS
    out = engine.generate([GenerationRequest(p, _params(i)) for i, p in enumerate(prompts)])
    ids = [engine.submit(GenerationRequest(p, _params(i + 1))) for i, p in enumerate(prompts)]
    got = []
    for _ in range(3):
        got += engine.step()
    engine.update_weights(other, 1, interrupt=True)
    got += engine.step() + engine.step()
    engine.update_weights(base, 2, interrupt=False)  # in-flight rows finish on a copy of v1
    engine.abort(ids[-1])
    got += engine.step()
    keys = list(other)
    parts = [
        {k: other[k] for k in keys[: len(keys) // 2]},
        {k: other[k] for k in keys[len(keys) // 2 :]},
    ]
    shapes = {k: tuple(v.shape) for k, v in other.items()}
    engine.update_weights_streamed(iter(parts), 3, shapes, interrupt=True)
    got += engine.drain()
    got.sort(key=lambda s: s.request_id)
    return [(s.response_ids, s.behaviour_logprobs, s.versions, s.finish_reason) for s in out + got]


CASES: dict[str, tuple[str, Callable[[RolloutEngine], None]]] = {
    "llama-direct": ("llama", lambda e: None),
    "llama-modules": ("llama", lambda e: setattr(e.runner, "direct", False)),
    "llama-padded": ("llama", lambda e: setattr(e.runner, "split_attention", False)),
    "gpt2-split": ("gpt2", lambda e: None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_engine_under_a_meta_default_device_runs_on_its_models_device(models, case) -> None:
    """Every engine operation inside ``torch.device("meta")``: all of it computes on the
    model's CPU, and the outputs equal those of the same run outside the context."""
    arch, setup = CASES[case]
    other = models[f"{arch}-1"].state_dict()

    def run(meta: bool) -> tuple[list[tuple], RolloutEngine]:
        model = copy.deepcopy(models[arch])  # made on the CPU, outside the context
        ctx = torch.device("meta") if meta else torch.device("cpu")
        with ctx:
            engine = RolloutEngine(model, eos_token_id=EOS, pad_token_id=PAD, max_slots=3)
            setup(engine)
            return _workload(engine, other), engine

    want, _ = run(meta=False)
    got, engine = run(meta=True)
    assert got == want  # tokens, logprobs (exact floats), versions, finish reasons
    assert engine.device == torch.device("cpu")
    assert engine.kv_cache._keys and all(k.device.type == "cpu" for k in engine.kv_cache._keys)
    # the first-use self-checks passed inside the context (a failed one falls back silently)
    kind = type(engine.model)
    if engine.runner.split_attention:
        assert engine.runner._split_ok[kind]
    if case == "llama-direct":
        assert engine.runner._direct_ok[kind]
    assert {v for r in got for v in r[2]} >= {0, 1, 3}  # the updates were exercised


def test_one_device_to_host_transfer_per_forward(models, monkeypatch) -> None:
    """Each forward brings back one tensor (tokens + logprobs): every ``tolist`` / ``item`` /
    ``cpu`` / ``numpy`` / ``bool`` / ``int`` / ``float`` of a tensor counts (each is a
    host <-> device sync on CUDA), over decode steps and steps with admissions, greedy and
    sampled rows."""
    # the device-generic sampler (sampler.sample's torch ops), as on CUDA: the CPU's C draw
    # (sample_rows_f32) reads the CPU tensors in place and makes no transfer at all
    monkeypatch.setattr(sampler, "C_DRAW", False)
    engine = RolloutEngine(
        copy.deepcopy(models["llama"]), eos_token_id=EOS, pad_token_id=PAD, max_slots=3
    )
    prompts = random_prompts([4, 8, 2, 6, 5], seed=7)
    for i, p in enumerate(prompts):
        engine.submit(GenerationRequest(p, _params(i)))
    engine.step()  # the first-use self-checks (they read results back) run here
    calls = []
    base = torch._C.TensorBase
    for name in ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__"):
        original = getattr(base, name)

        def counted(self, *a, _f=original, _n=name, **kw):  # type: ignore[no-untyped-def]
            calls.append(_n)
            return _f(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, name, counted)
    forwards = engine.runner.num_forwards
    n = 0
    while engine.has_unfinished():
        n += len(engine.step())
    monkeypatch.undo()
    forwards = engine.runner.num_forwards - forwards
    assert n == 5 and forwards >= 10
    assert calls == ["tolist"] * forwards


def test_to_host_is_exact_for_every_token_id_and_logprob() -> None:
    """One tensor back, nothing rounded: ids up to 2^24 - 1 through fp32, larger ids (a
    vocabulary over 2^24) through float64; the logprobs are the fp32 values themselves."""
    lp = torch.tensor([-0.1, -1e-8, -17.25], dtype=torch.float32)
    ids = torch.tensor([0, 7, (1 << 24) - 1])
    assert to_host(ids, lp, 1 << 24) == ([0, 7, 16777215], lp.tolist())
    big = torch.tensor([(1 << 24) + 1, 3, (1 << 30) + 7])  # 2^24 + 1 is not an fp32 number
    assert to_host(big, lp, 1 << 31) == ([16777217, 3, 1073741831], lp.tolist())
    assert float(torch.tensor(16777217.0, dtype=torch.float32)) == 16777216.0  # why the switch


def test_device_argument_is_checked_against_the_model(models) -> None:
    model = models["llama"]
    assert RolloutEngine(model, eos_token_id=EOS, pad_token_id=PAD, device="cpu").device == (
        torch.device("cpu")
    )
    with pytest.raises(ValueError, match=r"device='meta'.*parameters are on cpu"):
        RolloutEngine(model, eos_token_id=EOS, pad_token_id=PAD, device="meta")
    split = copy.deepcopy(model)
    split.lm_head.to("meta")
    with pytest.raises(ValueError, match=r"spread over several devices \(cpu, meta\)"):
        RolloutEngine(split, eos_token_id=EOS, pad_token_id=PAD)


def _spec(path: str, device: str = "cpu") -> EngineSpec:
    return EngineSpec(
        model_path=path,
        dtype="float32",
        eos_token_id=EOS,
        pad_token_id=PAD,
        max_slots=4,
        threads=1,
        version=0,
        urgent_steps=0,
        device=device,
    )


def test_engine_process_worker_builds_on_the_specs_device(models, tmp_path) -> None:
    """The engine process's two halves in this process: the client's shared weights on the
    spec's device (CPU: shared memory), the worker's engine there with those weights, and its
    samples equal to an engine on the same weights."""
    path = tmp_path / "m"
    models["llama"].save_pretrained(path)  # the worker loads the architecture from disk
    state = models["llama-1"].state_dict()
    spec = _spec(str(path))
    shared = shared_weights(state, spec.shared_device())
    assert all(t.device.type == "cpu" and t.is_shared() for t in shared.values())
    assert all(torch.equal(shared[k], v) for k, v in state.items())
    engine = build_own_engine(spec, shared)
    assert engine.device == torch.device("cpu")
    ref = RolloutEngine(copy.deepcopy(models["llama-1"]), eos_token_id=EOS, pad_token_id=PAD)
    reqs = [GenerationRequest(p, _params(i)) for i, p in enumerate(random_prompts([3, 7], 2))]
    assert [s.response_ids for s in engine.generate(reqs)] == [
        s.response_ids for s in ref.generate(reqs)
    ]
    assert engine.max_model_len == models["llama"].config.max_position_embeddings
    capped = EngineSpec(**{**spec.__dict__, "max_model_len": 32})  # rollout.max_model_len
    assert build_own_engine(capped, shared).max_model_len == 32
    assert _spec("x", "cuda:0").shared_device().type == "cuda"
    vllm = EngineSpec(**{**_spec("x", "cuda:0").__dict__, "backend": "vllm"})
    assert vllm.shared_device() == torch.device("cpu")  # vLLM places itself


@pytest.mark.skipif(CUDA, reason="checks the error of a machine without CUDA")
def test_engine_process_refuses_a_missing_device_before_spawning() -> None:
    with pytest.raises(ValueError, match=r"device='cuda:0' but this machine has 0 CUDA"):
        check_device(torch.device("cuda:0"))
    with pytest.raises(ValueError, match=r"device='meta'"):
        check_device(torch.device("meta"))


# --------------------------------------------------------------------------- CUDA only
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_cuda_engine_matches_cpu_and_syncs_once_per_forward(models) -> None:
    """On the GPU: greedy tokens as on the CPU, logprobs within 1e-4, sampled rows valid;
    at most one synchronising call per forward (``torch.cuda.set_sync_debug_mode``)."""
    import warnings

    cpu = RolloutEngine(copy.deepcopy(models["llama"]), eos_token_id=EOS, pad_token_id=PAD)
    gpu = RolloutEngine(copy.deepcopy(models["llama"]).cuda(), eos_token_id=EOS, pad_token_id=PAD)
    assert gpu.device.type == "cuda" and gpu.runner._check_direct(gpu.model)
    prompts = random_prompts([3, 9, 1, 14, 6], seed=5)
    greedy = [GenerationRequest(p, SamplingParams(greedy=True, max_tokens=12)) for p in prompts]
    a, b = cpu.generate(greedy), gpu.generate(greedy)
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(
            torch.tensor(y.behaviour_logprobs),
            torch.tensor(x.behaviour_logprobs),
            atol=1e-4,
            rtol=0,
        )
    # the same requests once first: a CUDA graph capture (``rollout.cuda_graphs``, on by
    # default on CUDA) synchronises the device, the counted run must only replay
    gpu.generate([GenerationRequest(p, _params(i)) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        gpu.submit(GenerationRequest(p, _params(i)))
    gpu.step()
    forwards = gpu.runner.num_forwards
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            gpu.drain()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) <= gpu.runner.num_forwards - forwards


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_cuda_engine_process_shares_weights_over_cuda_ipc(models, tmp_path) -> None:
    """The engine process on the GPU: shared weights on CUDA (IPC handles), an update loads
    into the worker, greedy samples equal an in-process GPU engine's."""
    from relayrl.cluster.engine_process import EngineProcess

    path = tmp_path / "m"
    models["llama"].save_pretrained(path)
    new = {k: v.cuda() for k, v in models["llama-1"].state_dict().items()}
    reqs = [GenerationRequest(p, SamplingParams(greedy=True, max_tokens=8)) for p in [[5, 6], [7]]]
    with EngineProcess(_spec(str(path), "cuda:0"), models["llama"].state_dict()) as proc:
        assert all(t.is_cuda for t in proc._shared.values())
        proc.update_weights(new, 1)
        proc.wait_weights_loaded()
        got = proc.generate(reqs)
    ref = RolloutEngine(copy.deepcopy(models["llama-1"]).cuda(), eos_token_id=EOS, pad_token_id=PAD)
    assert [s.response_ids for s in got] == [s.response_ids for s in ref.generate(reqs)]
    assert all(v == [1] * len(v) for v in (s.versions for s in got))
