"""``rollout.cuda_graphs``: the decode step CUDA graphs capture, checked on the CPU.

No graph is captured here: ``DecodeGraphs(capture=False)`` runs the very step a graph
captures (static buffers, batch rows = slots padded to a capture size, KV columns rounded to
a bucket, logits into the static buffer) eagerly, so its bucket, padding and invalidation
logic is checked against the normal path. Graphs themselves run in tools/device_run.py's
``decode`` step on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from relayrl.rollout import GenerationRequest, RolloutEngine, SamplingParams
from relayrl.rollout.cuda_graphs import DecodeGraphs, batch_bucket, capture_sizes, kv_bucket
from relayrl.rollout.kv_cache import SlotKVCache
from rollout_helpers import EOS, PAD, random_prompts, tiny_model

LOGPROB_ATOL = 1e-5
"""The static step's attention reads ``C >= kv_len`` columns (masked): the same math, but
fp32 sums over more columns round differently in the last place (measured: <= 5e-7)."""


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.nn.Module]:
    root = tmp_path_factory.mktemp("graph-models")
    return {arch: tiny_model(root, arch) for arch in ("llama", "qwen2")}


def _engine(model: torch.nn.Module, static: bool, max_slots: int = 5) -> RolloutEngine:
    engine = RolloutEngine(model, eos_token_id=EOS, pad_token_id=PAD, max_slots=max_slots)
    if static:
        engine.runner.graphs = DecodeGraphs(model, PAD, max_slots, "cpu", capture=False)
    return engine


def _requests(n: int = 9, seed: int = 21) -> list[GenerationRequest]:
    """Greedy, sampled, top-k and top-p rows of different prompt and answer lengths (slots
    are reused and left with holes as requests finish)."""
    lengths = [6, 2, 19, 1, 5, 7, 3, 40, 9, 4, 11][:n]
    out = []
    for i, p in enumerate(random_prompts(lengths, seed=seed)):
        params = SamplingParams(
            temperature=[0.0, 0.8, 1.0, 1.3][i % 4],
            top_k=5 if i % 3 == 0 else 0,
            top_p=0.9 if i % 5 == 1 else 1.0,
            max_tokens=12 + 7 * i,
            seed=i,
        )
        out.append(GenerationRequest(p, params, group_id=i % 3))
    return out


def _same(a: list, b: list) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.response_ids == y.response_ids
        assert x.versions == y.versions
        pairs = zip(x.behaviour_logprobs, y.behaviour_logprobs, strict=True)
        assert max(abs(p - q) for p, q in pairs) <= LOGPROB_ATOL


def test_capture_sizes_and_buckets() -> None:
    assert capture_sizes(256) == (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
    assert capture_sizes(5) == (1, 2, 4, 5)
    assert capture_sizes(1) == (1,)
    assert capture_sizes(300)[-3:] == (192, 256, 300)
    sizes = capture_sizes(64)
    assert [batch_bucket(n, sizes) for n in (1, 3, 9, 17, 25, 33, 64)] == [1, 4, 16, 24, 32, 48, 64]
    with pytest.raises(ValueError):
        batch_bucket(65, sizes)
    assert kv_bucket(3, 128) == 64  # at least MIN_KV_COLUMNS
    assert kv_bucket(65, 128) == 128
    assert kv_bucket(3, 16) == 16  # capped at the arenas' capacity
    assert kv_bucket(300, 1000) == 512 and kv_bucket(600, 1000) == 1000
    with pytest.raises(ValueError):
        kv_bucket(129, 128)


def test_off_on_the_cpu(models: dict) -> None:
    model = models["qwen2"]
    engine = RolloutEngine(model, eos_token_id=EOS, pad_token_id=PAD)
    assert engine.runner.graphs is None and engine.stats()["cuda_graphs"] is False
    with pytest.raises(ValueError, match="CUDA"):
        RolloutEngine(model, eos_token_id=EOS, pad_token_id=PAD, cuda_graphs=True)
    with pytest.raises(ValueError, match="CUDA"):
        DecodeGraphs(model, PAD, 4, "cpu", capture=True)
    assert DecodeGraphs(model, PAD, 4, "cpu").capture is False  # the default follows the device


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_static_step_gives_the_normal_paths_tokens(models: dict, arch: str) -> None:
    model = models[arch]
    static = _engine(model, static=True)
    _same(static.generate(_requests()), _engine(model, static=False).generate(_requests()))
    st = static.stats()
    assert st["cuda_graph_mode"] == "eager" and st["cuda_graph_disabled"] is None
    # every decode-only step went through the static step, on several (B, C) shapes
    assert st["cuda_graph_eager_steps"] > 50 and st["cuda_graph_replays"] == 0
    assert st["cuda_graph_captures"] == st["cuda_graphs_held"] >= 3


def test_urgent_steps_pad_the_rows_not_in_the_step(models: dict) -> None:
    """Urgent-only steps decode a subset of the live slots: the others are padding rows of
    the graph (their KV untouched), and the results are the normal path's."""
    model = models["llama"]
    runs = []
    for static in (True, False):
        engine = _engine(model, static=static)
        engine.prioritize([1])
        runs.append(engine.generate(_requests()))
        assert engine.stats()["urgent_steps"] > 0
    _same(*runs)


def test_padding_rows_write_only_their_trash_column(models: dict) -> None:
    model = models["qwen2"]
    engine = _engine(model, static=True, max_slots=4)
    runner, cache = engine.runner, engine.kv_cache
    assert isinstance(cache, SlotKVCache) and runner.graphs is not None
    prompts = random_prompts([5, 7, 3], seed=3)
    with torch.inference_mode():
        for slot, p in enumerate(prompts):  # three live slots, prefilled eagerly
            assert cache.allocate() == slot
            runner.execute(model, cache, [slot], [0], [p])
        before = [t.clone() for t in cache._keys + cache._values]
        logits = runner.execute(model, cache, [0, 2], [5, 3], [[9], [11]])  # slot 1 waits
    assert logits.shape[0] == 2 and runner.graphs.counts["eager_steps"] == 1
    trash = cache.capacity
    for old, new in zip(before, cache._keys + cache._values, strict=True):
        assert torch.equal(old[1, :, :trash], new[1, :, :trash])  # slot 1: not a column
        assert torch.equal(old[3], new[3])  # batch bucket 4: row 3 padding, never live
        assert not torch.equal(old[0, :, 5], new[0, :, 5])  # the step's own writes
        assert not torch.equal(old[2, :, 3], new[2, :, 3])


def test_weights_copied_in_place_keep_the_graphs_replaced_ones_drop_them(models: dict) -> None:
    model = models["llama"]
    original = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        static, plain = _engine(model, static=True), _engine(model, static=False)
        _same(static.generate(_requests(4)), plain.generate(_requests(4)))
        graphs = static.runner.graphs
        assert graphs is not None
        held = graphs.stats()["cuda_graphs_held"]
        g = torch.Generator().manual_seed(5)
        new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in original.items()}
        static.update_weights(new, version=1)  # load_state_dict: copied in place
        plain.update_weights(new, version=1)
        assert graphs.counts["invalidations"] == 0 and graphs.stats()["cuda_graphs_held"] == held
        _same(static.generate(_requests(4, seed=2)), plain.generate(_requests(4, seed=2)))
        with torch.no_grad():  # a tensor replaced behind the engine's back: it moved
            norm = model.model.norm
            norm.weight = torch.nn.Parameter(norm.weight.detach().clone())
        _same(static.generate(_requests(4, seed=3)), plain.generate(_requests(4, seed=3)))
        assert graphs.counts["invalidations"] == 1
    finally:
        model.load_state_dict(original)


def test_arena_growth_drops_the_graphs_and_old_weights_run_eagerly(models: dict) -> None:
    model = models["qwen2"]
    static, plain = _engine(model, static=True, max_slots=3), _engine(model, static=False)
    long = [
        GenerationRequest(p, SamplingParams(max_tokens=110, ignore_eos=True))
        for p in random_prompts([40, 9], seed=4)
    ]
    _same(static.generate(long), plain.generate(long))
    graphs = static.runner.graphs
    assert graphs is not None
    assert static.kv_cache.capacity > 128 and graphs.counts["invalidations"] >= 1
    # an update without interrupt: in-flight rows finish on a copy of the old weights,
    # which runs eagerly (the graphs belong to the engine's model)
    for engine in (static, plain):
        engine.submit(GenerationRequest([5, 6, 7], SamplingParams(max_tokens=30, seed=1)))
        engine.step()
        engine.step()
    steps = graphs.counts["eager_steps"]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    static.update_weights(state, version=1, interrupt=False)
    plain.update_weights(state, version=1, interrupt=False)
    assert static.stats()["weight_copies"] == 2
    _same(static.drain(), plain.drain())
    assert graphs.counts["eager_steps"] == steps  # the old copy's steps did not use it


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_replays_equal_the_static_step_run_eagerly(models: dict) -> None:
    """On the GPU: graphs captured and replayed give the bits of the same static step run
    eagerly, and the eager engine's greedy tokens; no capture fails."""
    import copy

    model = copy.deepcopy(models["llama"]).cuda()
    graphed = RolloutEngine(model, eos_token_id=EOS, pad_token_id=PAD, max_slots=5)
    static = RolloutEngine(
        model, eos_token_id=EOS, pad_token_id=PAD, max_slots=5, cuda_graphs=False
    )
    static.runner.graphs = DecodeGraphs(model, PAD, 5, model.device, capture=False)
    plain = RolloutEngine(model, eos_token_id=EOS, pad_token_id=PAD, max_slots=5, cuda_graphs=False)
    a, b = graphed.generate(_requests()), static.generate(_requests())
    for x, y in zip(a, b, strict=True):
        assert x.response_ids == y.response_ids
        assert x.behaviour_logprobs == y.behaviour_logprobs  # bitwise
    st = graphed.stats()
    assert st["cuda_graph_disabled"] is None and st["cuda_graph_replays"] > 50
    greedy = [
        GenerationRequest(p, SamplingParams(greedy=True, max_tokens=20))
        for p in random_prompts([5, 9, 2], seed=8)
    ]
    assert [s.response_ids for s in graphed.generate(greedy)] == [
        s.response_ids for s in plain.generate(greedy)
    ]


class _FakeGraph:
    """Stands in for ``torch.cuda.CUDAGraph`` on the CPU: the "capture" records the step's
    arguments, a replay runs the step again on the buffers as they are then."""

    def __init__(self) -> None:
        self.step: tuple | None = None

    def replay(self) -> None:
        assert self.step is not None
        graphs, args = self.step
        DecodeGraphs._step(graphs, *args)


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, fail: bool) -> None:
    """Enough of ``torch.cuda`` for ``DecodeGraphs._capture`` to run on the CPU."""
    import contextlib

    class Stream:
        def __init__(self, *a: object) -> None: ...

        def wait_stream(self, other: object) -> None: ...

    recorded: list[_FakeGraph] = []

    @contextlib.contextmanager
    def graph(g: _FakeGraph, pool: object = None, capture_error_mode: str = "global"):
        assert capture_error_mode == "thread_local" and pool is not None
        if fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        recorded.append(g)
        yield

    real_step = DecodeGraphs._step

    def step(self: DecodeGraphs, *args: object) -> None:
        if recorded and recorded[-1].step is None:
            recorded[-1].step = (self, args)
        real_step(self, *args)

    monkeypatch.setattr(DecodeGraphs, "_step", step)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", graph)


@pytest.mark.parametrize("fail", [False, True])
def test_capture_path_on_padding_rows_and_a_failed_capture(
    models: dict, monkeypatch: pytest.MonkeyPatch, fail: bool
) -> None:
    """The capture path with ``torch.cuda`` faked: warm-up and capture run on padding rows
    only (the live KV is untouched: the results are the normal path's), replays follow; a
    capture that fails turns graphs off with its reason and the engine goes on eagerly."""
    model = models["qwen2"]
    engine = _engine(model, static=True)
    graphs = engine.runner.graphs
    assert graphs is not None
    graphs.capture = True  # (the constructor refuses it on the CPU)
    _fake_cuda(monkeypatch, fail)
    _same(engine.generate(_requests()), _engine(model, static=False).generate(_requests()))
    st = engine.stats()
    if fail:
        assert "operation not permitted" in st["cuda_graph_disabled"]
        assert st["cuda_graph_replays"] == 0 and st["cuda_graphs_held"] == 0
    else:
        assert st["cuda_graph_disabled"] is None and st["cuda_graph_eager_steps"] == 0
        assert st["cuda_graph_replays"] > 50 and st["cuda_graphs_held"] >= 3
