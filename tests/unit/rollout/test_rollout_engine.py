"""RolloutEngine: greedy == transformers, logprobs == recompute, seeds, refill, bad input."""

from __future__ import annotations

import pytest
import torch

from relayrl.rollout import (
    GenerationRequest,
    InvalidRequestError,
    RolloutEngine,
    SamplingParams,
)
from rollout_helpers import (
    EOS,
    PAD,
    hf_greedy,
    random_prompts,
    recompute_logprobs,
    tiny_model,
)

ARCHS = ["llama", "gpt2", "qwen2"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.nn.Module]:
    root = tmp_path_factory.mktemp("rollout-models")
    return {arch: tiny_model(root, arch) for arch in ARCHS}


def make_engine(model: torch.nn.Module, **kw: object) -> RolloutEngine:
    return RolloutEngine(model, eos_token_id=EOS, pad_token_id=PAD, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers_generate(models: dict, arch: str) -> None:
    model = models[arch]
    prompts = random_prompts([3, 11, 1, 7, 15, 5, 9, 2, 13, 4], seed=1)
    # Fewer slots than prompts: slots are refilled while others are mid-generation.
    engine = make_engine(model, max_slots=4)
    samples = engine.generate(
        [GenerationRequest(p, SamplingParams(greedy=True, max_tokens=24)) for p in prompts]
    )
    expected = hf_greedy(model, prompts, max_new_tokens=24)
    for p, s, ref in zip(prompts, samples, expected, strict=True):
        assert s.prompt_ids == p
        assert s.response_ids == ref
        assert s.finish_reason == ("eos" if ref[-1] == EOS else "length")
        assert s.versions == [0] * len(ref)
        torch.testing.assert_close(
            torch.tensor(s.behaviour_logprobs), recompute_logprobs(model, p, ref), atol=1e-5, rtol=0
        )


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behaviour_logprobs_equal_recompute(models: dict, arch: str, temperature: float) -> None:
    model = models[arch]
    prompts = random_prompts([4, 9, 2, 12, 6, 3], seed=2)
    engine = make_engine(model, max_slots=3)
    reqs = [
        GenerationRequest(p, SamplingParams(temperature=temperature, max_tokens=30, seed=i))
        for i, p in enumerate(prompts)
    ]
    samples = engine.generate(reqs)
    for p, s in zip(prompts, samples, strict=True):
        assert len(s.response_ids) == len(s.behaviour_logprobs) == len(s.versions) >= 1
        ref = recompute_logprobs(model, p, s.response_ids, temperature)
        torch.testing.assert_close(torch.tensor(s.behaviour_logprobs), ref, atol=1e-5, rtol=0)


def test_logprobs_match_trainer_forward_logprobs(models: dict) -> None:
    """Same check through the trainer's padded-batch recompute (relayrl.model.batching)."""
    try:
        from relayrl.algos import logprobs_from_logits  # noqa: F401
    except ImportError:
        pytest.skip("relayrl.algos not available yet")
    from relayrl.model.batching import forward_logprobs, pack_batch

    model = models["llama"]
    prompts = random_prompts([5, 1, 10, 3], seed=3)
    engine = make_engine(model, max_slots=2)
    samples = engine.generate(
        [
            GenerationRequest(p, SamplingParams(temperature=0.7, max_tokens=16, seed=7 + i))
            for i, p in enumerate(prompts)
        ]
    )
    batch = pack_batch(prompts, [s.response_ids for s in samples], PAD)
    with torch.no_grad():
        logp, _ = forward_logprobs(model, batch, temperature=0.7)
    for i, s in enumerate(samples):
        n = len(s.response_ids)
        torch.testing.assert_close(
            torch.tensor(s.behaviour_logprobs), logp[i, :n], atol=1e-5, rtol=0
        )


def test_top_k_top_p_logprobs_are_under_the_filtered_distribution(models: dict) -> None:
    model = models["llama"]
    (prompt,) = random_prompts([6], seed=4)
    engine = make_engine(model)
    params = SamplingParams(temperature=0.8, top_k=5, top_p=0.6, max_tokens=12, seed=3)
    (s,) = engine.generate([GenerationRequest(prompt, params)])
    ids = torch.tensor([prompt + s.response_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / 0.8
    for t, tok in enumerate(s.response_ids):
        row = logits[t]
        top = row.topk(5)
        probs = top.values.softmax(-1)
        keep = (probs.cumsum(-1) - probs) < 0.6  # nucleus inside the top-5
        kept_ids = top.indices[keep]
        assert tok in kept_ids.tolist()
        expected = torch.log_softmax(top.values[keep], -1)[kept_ids.tolist().index(tok)]
        assert abs(s.behaviour_logprobs[t] - expected.item()) < 1e-5


def test_seeded_sampling_is_reproducible_regardless_of_batch(models: dict) -> None:
    model = models["llama"]
    prompts = random_prompts([5, 8, 3, 10, 7], seed=5)
    params = SamplingParams(temperature=1.0, max_tokens=20, seed=1234)
    alone = make_engine(model, max_slots=1).generate([GenerationRequest(prompts[0], params)])[0]
    others = [
        GenerationRequest(p, SamplingParams(temperature=0.9, top_k=20, max_tokens=25, seed=i))
        for i, p in enumerate(prompts[1:])
    ]
    # Same request submitted last, into a busy engine with other slots and other requests.
    crowded = make_engine(model, max_slots=3).generate(
        [*others, GenerationRequest(prompts[0], params)]
    )
    assert crowded[-1].response_ids == alone.response_ids
    assert crowded[-1].behaviour_logprobs == pytest.approx(alone.behaviour_logprobs, abs=1e-5)
    other_seed = SamplingParams(temperature=1.0, max_tokens=20, seed=99)
    diff = make_engine(model).generate([GenerationRequest(prompts[0], other_seed)])[0]
    assert diff.response_ids != alone.response_ids


def test_unseeded_requests_differ_and_engine_seed_reproduces(models: dict) -> None:
    model = models["gpt2"]
    (prompt,) = random_prompts([4], seed=6)
    reqs = [GenerationRequest(prompt, SamplingParams(max_tokens=15)) for _ in range(4)]
    a = make_engine(model, seed=3).generate(reqs)
    b = make_engine(model, seed=3).generate(reqs)
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    assert len({tuple(s.response_ids) for s in a}) > 1


def test_finish_reasons_stop_and_length(models: dict) -> None:
    model = models["llama"]
    (prompt,) = random_prompts([5], seed=7)
    engine = make_engine(model)
    (free,) = engine.generate(
        [GenerationRequest(prompt, SamplingParams(greedy=True, max_tokens=8))]
    )
    assert free.finish_reason in ("length", "eos")
    # Stop on the 4th greedy token: it is included, finish 'stop'.
    stop_tok = free.response_ids[3]
    first = free.response_ids.index(stop_tok)
    params = SamplingParams(greedy=True, max_tokens=8, stop_token_ids=[stop_tok])
    (stopped,) = engine.generate([GenerationRequest(prompt, params)])
    assert stopped.response_ids == free.response_ids[: first + 1]
    assert stopped.finish_reason == "stop"
    # The context length caps the response: finish 'length' at max_model_len tokens total.
    short = make_engine(model, max_model_len=len(prompt) + 3)
    (capped,) = short.generate(
        [GenerationRequest(prompt, SamplingParams(max_tokens=50, ignore_eos=True, seed=0))]
    )
    assert len(capped.response_ids) == 3 and capped.finish_reason == "length"


def test_eos_is_included_with_its_logprob(models: dict) -> None:
    model = models["llama"]
    prompts = random_prompts([3] * 24, seed=8)
    engine = make_engine(model, max_slots=8)
    samples = engine.generate(
        [
            GenerationRequest(p, SamplingParams(temperature=1.5, max_tokens=60, seed=i))
            for i, p in enumerate(prompts)
        ]
    )
    eos_samples = [s for s in samples if s.finish_reason == "eos"]
    assert eos_samples, "expected at least one EOS at temperature 1.5"
    for s in eos_samples:
        assert s.response_ids[-1] == EOS and EOS not in s.response_ids[:-1]
        ref = recompute_logprobs(model, s.prompt_ids, s.response_ids, 1.5)
        assert abs(s.behaviour_logprobs[-1] - ref[-1].item()) < 1e-5


def test_finished_slot_is_refilled_at_once(models: dict) -> None:
    model = models["llama"]
    prompts = random_prompts([3, 5, 2, 4, 6, 3, 2, 5], seed=9)
    engine = make_engine(model, max_slots=3)
    lengths = [2, 9, 4, 3, 7, 5, 1, 6]
    for p, n in zip(prompts, lengths, strict=True):
        engine.submit(GenerationRequest(p, SamplingParams(max_tokens=n, ignore_eos=True, seed=0)))
    rows_per_step = []
    samples = []
    while engine.has_unfinished():
        live = len(engine.scheduler.waiting) + len(engine.scheduler.running)
        before = engine.stats()["slot_steps"]
        samples += engine.step()
        rows = engine.stats()["slot_steps"] - before
        assert rows == min(3, live), "a slot sat idle while a request was waiting"
        rows_per_step.append(rows)
    assert sorted(len(s.response_ids) for s in samples) == sorted(lengths)
    assert sum(rows_per_step) == sum(lengths)  # one row per generated token, no idle rows
    report = engine.report()  # the rollout-backend interface: counters, no spans in process
    assert report.counters["slot_steps"] == sum(lengths) and report.busy_spans == []
    assert report.counters["tokens_generated"] == sum(lengths)


def test_bad_input_raises_clear_errors_without_disturbing_others(models: dict) -> None:
    model = models["llama"]
    engine = make_engine(model, max_slots=2, max_model_len=32)
    vocab = model.get_output_embeddings().out_features
    good = random_prompts([4, 6], seed=10)
    ids = [engine.submit(GenerationRequest(good[0], SamplingParams(greedy=True, max_tokens=5)))]
    engine.step()  # the good request is mid-generation
    cases = [
        (GenerationRequest([], SamplingParams()), "empty"),
        (GenerationRequest([5] * 32, SamplingParams()), "max_model_len"),
        (GenerationRequest([5] * 40, SamplingParams()), "max_model_len"),
        (GenerationRequest([5], SamplingParams(stop_token_ids=[vocab])), "stop token id"),
        (GenerationRequest([5], SamplingParams(stop_token_ids=[-1])), "stop token id"),
        (GenerationRequest([5], SamplingParams(max_tokens=0)), "max_tokens"),
        (GenerationRequest([5], SamplingParams(max_tokens=-3)), "max_tokens"),
        (GenerationRequest([5, vocab + 3], SamplingParams()), "prompt token id"),
        (GenerationRequest([5], SamplingParams(top_p=0.0)), "top_p"),
        (GenerationRequest([5], SamplingParams(temperature=-1.0)), "temperature"),
    ]
    for req, words in cases:
        with pytest.raises(InvalidRequestError, match=words):
            engine.submit(req)
        with pytest.raises(ValueError):  # InvalidRequestError is a ValueError
            engine.submit(req)
    ids.append(engine.submit(GenerationRequest(good[1], SamplingParams(greedy=True, max_tokens=5))))
    done = {s.request_id: s for s in engine.drain()}
    assert set(done) == set(ids)
    reference = make_engine(model).generate(
        [GenerationRequest(p, SamplingParams(greedy=True, max_tokens=5)) for p in good]
    )
    assert [done[i].response_ids for i in ids] == [r.response_ids for r in reference]
    # generate(): a bad request becomes an 'abort' sample with an error, in its place.
    out = engine.generate(
        [
            GenerationRequest(good[0], SamplingParams(greedy=True, max_tokens=5)),
            GenerationRequest([], SamplingParams()),
            GenerationRequest(good[1], SamplingParams(greedy=True, max_tokens=5)),
        ]
    )
    assert out[1].finish_reason == "abort" and "empty" in (out[1].error or "")
    assert out[0].error is None and out[0].response_ids == reference[0].response_ids
    assert out[2].response_ids == reference[1].response_ids


def test_abort_waiting_and_running(models: dict) -> None:
    model = models["gpt2"]
    prompts = random_prompts([3, 4, 5], seed=11)
    engine = make_engine(model, max_slots=1)
    params = SamplingParams(max_tokens=20, ignore_eos=True, seed=0)
    a, b, c = (engine.submit(GenerationRequest(p, params)) for p in prompts)
    engine.step()
    engine.step()
    assert engine.abort(a) and engine.abort(c)  # a is running, c is waiting
    assert not engine.abort(12345)
    out = {s.request_id: s for s in engine.drain()}
    assert out[a].finish_reason == "abort" and len(out[a].response_ids) == 2
    assert len(out[a].behaviour_logprobs) == len(out[a].versions) == 2
    assert out[c].finish_reason == "abort" and out[c].response_ids == []
    assert out[b].finish_reason == "length" and len(out[b].response_ids) == 20
    assert not engine.abort(b)


def test_progress_reads_a_running_requests_tokens_so_far(models: dict) -> None:
    """``progress(rid, start)``: the response from index ``start`` while the request runs
    (None while it waits or once it finished); the pieces join to the finished sample."""
    prompts = random_prompts([3, 4], seed=13)
    engine = make_engine(models["llama"], max_slots=1)
    params = SamplingParams(max_tokens=5, ignore_eos=True, seed=1)
    a, b = (engine.submit(GenerationRequest(p, params)) for p in prompts)
    assert engine.progress(a) is None  # waiting: not admitted yet
    ids: list[int] = []
    lps: list[float] = []
    vs: list[int] = []
    done = []
    while not done:
        done = [s for s in engine.step() if s.request_id == a]
        new = engine.progress(a, len(ids))
        if not done:
            assert new is not None and len(new[0]) == 1  # one token a step
            ids, lps, vs = ids + new[0], lps + new[1], vs + new[2]
            assert engine.progress(b) is None  # still waiting for the one slot
    assert new is None  # finished
    (s,) = done
    assert ids == s.response_ids[:4] and lps == s.behaviour_logprobs[:4] and vs == s.versions[:4]
    assert engine.progress(12345) is None
    engine.drain()


def test_iter_finished_and_group_metadata(models: dict) -> None:
    model = models["llama"]
    prompts = random_prompts([3, 4], seed=12)
    engine = make_engine(model, max_slots=2)
    for i, p in enumerate(prompts):
        engine.submit(
            GenerationRequest(
                p, SamplingParams(max_tokens=3 + i, seed=i), group_id=7, metadata={"i": i}
            )
        )
    seen = list(engine.iter_finished())
    assert sorted(s.metadata["i"] for s in seen) == [0, 1]
    assert all(s.group_id == 7 for s in seen)
    assert not engine.has_unfinished()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(
    "runner_opts",
    [
        {"split_attention": False},  # padded fallback: decode + padded prefill forwards
        {"max_prefill_tokens": 4},  # split attention, prefills chunked over forwards
        {"dense_fraction": 1.01},  # slot rows always gathered, never a view with dummies
        # decode rows in length buckets from 2 tokens up, every class its own bucket
        {"bucket_overhead": 1, "bucket_min_len": 2},
        {"prefill_call_cost": 0},  # a step's prompts attend one call each, never one block
    ],
)
def test_every_runner_path_matches_recompute(models: dict, arch: str, runner_opts: dict) -> None:
    model = models[arch]
    prompts = random_prompts([6, 2, 9, 1, 5, 7, 3], seed=13)
    reqs = [
        GenerationRequest(p, SamplingParams(temperature=0.7, max_tokens=18, seed=i))
        for i, p in enumerate(prompts)
    ]
    reference = make_engine(model, max_slots=3).generate(reqs)
    engine = make_engine(model, max_slots=3)
    for k, v in runner_opts.items():
        setattr(engine.runner, k, v)
    samples = engine.generate(reqs)
    for p, s, ref in zip(prompts, samples, reference, strict=True):
        assert s.response_ids == ref.response_ids
        lp = recompute_logprobs(model, p, s.response_ids, 0.7)
        torch.testing.assert_close(torch.tensor(s.behaviour_logprobs), lp, atol=1e-5, rtol=0)
    if runner_opts.get("split_attention", True):
        assert engine.runner.supports_split(model)


def test_split_attention_leaves_the_model_untouched(models: dict) -> None:
    """The attention swap lasts one forward: plain calls of the same module are unchanged."""
    model = models["llama"]
    ids = torch.tensor([random_prompts([7], seed=14)[0]])
    with torch.no_grad():
        before = model(input_ids=ids).logits
    make_engine(model).generate([GenerationRequest(ids[0].tolist(), SamplingParams(max_tokens=5))])
    assert model.config._attn_implementation == "sdpa"
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, before)


@pytest.mark.parametrize("arch", ARCHS)
def test_kv_arena_grows_mid_generation(models: dict, arch: str) -> None:
    """Sequences longer than the arena's initial capacity (128): growth keeps the contents."""
    model = models[arch]
    prompts = random_prompts([150, 10, 40], seed=15)
    engine = make_engine(model, max_slots=2)
    assert engine.kv_cache.capacity == 128
    params = [SamplingParams(greedy=True, max_tokens=n) for n in (6, 180, 100)]
    samples = engine.generate(
        [GenerationRequest(p, q) for p, q in zip(prompts, params, strict=True)]
    )
    assert engine.kv_cache.capacity == 256
    for p, q, s in zip(prompts, params, samples, strict=True):
        (ref,) = hf_greedy(model, [p], max_new_tokens=q.max_tokens)
        assert s.response_ids == ref


def test_sampler_uniforms_are_stateless_and_uniform() -> None:
    from relayrl.rollout.sampler import uniform

    u = torch.tensor([uniform(7, t) for t in range(20000)], dtype=torch.float64)
    assert 0.0 <= float(u.min()) and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(u.var()) - 1 / 12) < 0.005
    assert uniform(7, 3) == uniform(7, 3) != uniform(8, 3)


def test_decode_length_buckets_hand_case() -> None:
    """Classes <= 32, <= 64, <= 512 here; a class joins the next while the extra columns it
    would read there (rows x (next longest - own longest)) cost less than the overhead."""
    from relayrl.rollout.model_runner import ModelRunner

    lengths = [5, 40, 33, 300, 10]
    runner = ModelRunner(PAD, 8, bucket_overhead=4096)
    # 2 x (40 - 10) = 60 < 4096, then 4 x (300 - 40) = 1040 < 4096: one bucket
    assert runner._decode_buckets(lengths) is None
    runner.bucket_overhead = 1000  # 1040 >= 1000: the straggler reads its 300 columns alone
    assert runner._decode_buckets(lengths) == [[0, 1, 2, 4], [3]]
    runner.bucket_overhead = 50  # 60 >= 50: every class alone
    assert runner._decode_buckets(lengths) == [[0, 4], [1, 2], [3]]
    runner.bucket_overhead = 0  # off
    assert runner._decode_buckets(lengths) is None


def test_urgent_groups_decode_alone_between_full_steps(models: dict) -> None:
    """``prioritize``: each full step is followed by ``urgent_steps`` steps of the urgent rows
    alone, so they advance (urgent_steps + 1)x as fast; the rest still advances every full
    step, and every request's tokens are the same as without priority (per-request seeds)."""
    model = models["llama"]
    prompts = random_prompts([3, 5, 4, 6, 2, 7], seed=11)

    def run(urgent: list[int]) -> tuple[dict[int, list[int]], dict[int, int]]:
        engine = make_engine(model, max_slots=8, urgent_steps=2)
        for i, p in enumerate(prompts):  # group 1: requests 4 and 5
            params = SamplingParams(max_tokens=30, ignore_eos=True, seed=i)
            engine.submit(GenerationRequest(p, params, group_id=int(i >= 4)))
        engine.prioritize(urgent)
        tokens, finished_at = {}, {}
        steps = 0
        while engine.has_unfinished():
            steps += 1
            for s in engine.step():
                tokens[s.request_id] = s.response_ids
                finished_at[s.request_id] = steps
        return tokens, finished_at

    plain_tokens, plain_at = run([])
    tokens, at = run([1])
    assert tokens == plain_tokens  # same samples, only their order in time changed
    assert max(plain_at.values()) == 30  # one token per step for every row
    # the urgent pair: a full step + 2 alone per 3 steps -> 30 tokens in 30 steps as before
    assert at[4] == at[5] == 30
    # ... while each other row got one token per full step, so they finish last
    assert min(at[i] for i in range(4)) > 30
    # without anything urgent running, every step is a full step again
    assert max(at.values()) <= 30 + 20 + 1


def test_urgent_steps_off_and_bad_value(models: dict) -> None:
    model = models["llama"]
    engine = make_engine(model, max_slots=4, urgent_steps=0)
    engine.submit(GenerationRequest([5, 6], SamplingParams(max_tokens=3), group_id=0))
    engine.submit(GenerationRequest([5, 7], SamplingParams(max_tokens=3), group_id=1))
    engine.prioritize([1])
    while engine.has_unfinished():
        engine.step()
    assert engine.stats()["urgent_steps"] == 0
    with pytest.raises(ValueError, match="urgent_steps"):
        make_engine(model, urgent_steps=-1)


def test_kv_cache_reads_gather_with_index_select_as_advanced_indexing() -> None:
    from relayrl.rollout.kv_cache import read_rows

    arena = torch.randn(6, 2, 9, 4)
    rows = torch.tensor([0, 2, 5])
    assert torch.equal(read_rows(arena, rows, 7), arena[rows, :, :7])
    view = read_rows(arena, slice(1, 4), 5)
    assert view.data_ptr() == arena[1].data_ptr() and torch.equal(view, arena[1:4, :, :5])


def test_prompt_by_prompt_prefill_attention_hand_case() -> None:
    """One block-diagonal call costs c + P^2 query-key pairs, a call per prompt c + p^2 each."""
    from relayrl.rollout.model_runner import ModelRunner

    runner = ModelRunner(PAD, 8, prefill_call_cost=2048)
    assert not runner._prompt_by_prompt([20, 20])  # 4096 + 800 >= 2048 + 1600
    assert runner._prompt_by_prompt([20] * 32)  # 32 x 2048 + 12800 < 2048 + 409600
    assert not runner._prompt_by_prompt([20] * 4)  # 8192 + 1600 >= 2048 + 6400
    assert runner._prompt_by_prompt([20] * 8)  # 16384 + 3200 < 2048 + 25600
    assert runner._prompt_by_prompt([20])  # one prompt: one call either way, no mask


def test_kv_arena_growth_steps_hand_case() -> None:
    """x2 steps; the last one goes straight to max_len (128 -> 256 -> 289 would copy twice)."""
    from relayrl.rollout.kv_cache import SlotKVCache

    cache = SlotKVCache(2, 289)
    assert cache.capacity == 128
    cache.ensure_capacity(129)
    assert cache.capacity == 289
    cache = SlotKVCache(2, 1000)
    cache.ensure_capacity(129)
    assert cache.capacity == 256  # 2 x 256 <= 1000: room for another doubling
    cache.ensure_capacity(300)
    assert cache.capacity == 1000  # 512 would leave less than a doubling (2 x 512 > 1000)
    with pytest.raises(ValueError, match="max_len is 1000"):
        cache.ensure_capacity(1001)
