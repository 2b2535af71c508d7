"""RolloutEngine weight updates: interrupt (re-prefill, version switch) and non-interrupt."""

from __future__ import annotations

import copy

import pytest
import torch

from relayrl.rollout import GenerationRequest, RolloutEngine, SamplingParams
from rollout_helpers import EOS, PAD, random_prompts, recompute_logprobs, tiny_model


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Two tiny Llamas with the same shapes and different random weights."""
    root = tmp_path_factory.mktemp("rollout-weights")
    return tiny_model(root, "llama", seed=0), tiny_model(root, "llama", seed=1)


def make_engine(model: torch.nn.Module, **kw: object) -> RolloutEngine:
    # The engine loads new weights into its module in place: give it its own copy.
    return RolloutEngine(copy.deepcopy(model), eos_token_id=EOS, pad_token_id=PAD, **kw)  # type: ignore[arg-type]


@torch.no_grad()
def greedy_continuation(model: torch.nn.Module, prefix: list[int], n: int) -> list[int]:
    """n argmax tokens after ``prefix`` by full forwards (no cache, no EOS stop)."""
    ids = list(prefix)
    for _ in range(n):
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(prefix) :]


def live_progress(engine: RolloutEngine) -> dict[int, int]:
    """Request id -> tokens generated so far, for the sequences in flight."""
    return {rid: seq.num_generated for rid, seq in engine.scheduler.running.items()}


def test_interrupt_switches_versions_exactly_and_continues_under_new_weights(weights) -> None:
    old, new = weights
    prompts = random_prompts([4, 9, 2, 6, 5], seed=20)
    engine = make_engine(old, max_slots=3)
    params = SamplingParams(greedy=True, max_tokens=12, ignore_eos=True)
    ids = [engine.submit(GenerationRequest(p, params)) for p in prompts]
    done = []
    for _ in range(4):
        done += engine.step()
    progress = live_progress(engine)
    waiting = {seq.request_id for seq in engine.scheduler.waiting}
    assert progress and waiting  # some in flight, some not admitted yet
    engine.update_weights(new.state_dict(), version=1, interrupt=True)
    assert engine.version == 1
    done += engine.drain()
    by_id = {s.request_id: s for s in done}
    assert set(by_id) == set(ids)
    for rid, prompt in zip(ids, prompts, strict=True):
        s = by_id[rid]
        resp = s.response_ids
        assert len(resp) == 12
        j = progress.get(rid, 0 if rid in waiting else 12)
        assert s.versions == [0] * j + [1] * (12 - j)
        assert s.num_interrupts == (1 if rid in progress else 0)
        # Before the switch: the old weights' greedy tokens; after: the new weights' greedy
        # continuation of exactly that prefix.
        assert resp[:j] == greedy_continuation(old, prompt, j)
        assert resp[j:] == greedy_continuation(new, prompt + resp[:j], 12 - j)
        lp = torch.tensor(s.behaviour_logprobs)
        torch.testing.assert_close(
            lp[:j], recompute_logprobs(old, prompt, resp)[:j], atol=1e-5, rtol=0
        )
        torch.testing.assert_close(
            lp[j:], recompute_logprobs(new, prompt, resp)[j:], atol=1e-5, rtol=0
        )
    st = engine.stats()
    assert st["sequences_interrupted"] == len(progress) and st["weight_updates"] == 1
    assert st["weight_copies"] == 1


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_match_recompute_across_several_interrupts(weights, temperature) -> None:
    old, new = weights
    models = {0: old, 1: new, 2: old}
    prompts = random_prompts([3, 7, 5, 10], seed=21)
    engine = make_engine(old, max_slots=4)
    reqs = [
        GenerationRequest(p, SamplingParams(temperature=temperature, max_tokens=20, seed=i))
        for i, p in enumerate(prompts)
    ]
    for r in reqs:
        engine.submit(r)
    out = engine.step() + engine.step() + engine.step()
    engine.update_weights(new.state_dict(), version=1)
    out += engine.step() + engine.step()
    engine.update_weights(old.state_dict(), version=2)
    out += engine.drain()
    assert len(out) == 4
    switched = 0
    for s in out:
        v = torch.tensor(s.versions)
        assert (v[1:] >= v[:-1]).all()  # versions never go back within a sample
        lp = torch.tensor(s.behaviour_logprobs)
        for version, model in models.items():
            sel = v == version
            if sel.any():
                ref = recompute_logprobs(model, s.prompt_ids, s.response_ids, temperature)
                torch.testing.assert_close(lp[sel], ref[sel], atol=1e-5, rtol=0)
        switched += len(set(s.versions)) > 1
    assert switched >= 1


def test_interrupt_with_unchanged_weights_does_not_change_samples(weights) -> None:
    """Dropping the KV and re-prefilling is invisible: same tokens, same logprobs."""
    old, _ = weights
    prompts = random_prompts([5, 8, 3], seed=22)
    reqs = [
        GenerationRequest(p, SamplingParams(temperature=0.8, top_p=0.9, max_tokens=15, seed=i))
        for i, p in enumerate(prompts)
    ]
    plain = make_engine(old, max_slots=2).generate(reqs)
    engine = make_engine(old, max_slots=2)
    ids = [engine.submit(r) for r in reqs]
    out = engine.step() + engine.step() + engine.step()
    engine.update_weights(old.state_dict(), version=7)
    out += engine.step()
    engine.update_weights(old.state_dict(), version=8)
    by_id = {s.request_id: s for s in out + engine.drain()}
    for rid, ref in zip(ids, plain, strict=True):
        s = by_id[rid]
        assert s.response_ids == ref.response_ids
        assert s.behaviour_logprobs == pytest.approx(ref.behaviour_logprobs, abs=1e-5)
    assert any(s.num_interrupts == 2 for s in by_id.values())


def test_non_interrupt_update_finishes_in_flight_on_old_weights(weights) -> None:
    old, new = weights
    prompts = random_prompts([4, 6, 3, 7, 5], seed=23)
    engine = make_engine(old, max_slots=2)
    params = SamplingParams(greedy=True, max_tokens=10, ignore_eos=True)
    ids = [engine.submit(GenerationRequest(p, params)) for p in prompts]
    out = engine.step() + engine.step() + engine.step()
    in_flight = set(live_progress(engine))
    assert len(in_flight) == 2
    engine.update_weights(new.state_dict(), version=1, interrupt=False)
    assert engine.stats()["weight_copies"] == 2  # the old weights live on for in-flight work
    late = engine.submit(GenerationRequest(prompts[0], params))
    out += engine.drain()
    by_id = {s.request_id: s for s in out}
    for rid, prompt in zip([*ids, late], [*prompts, prompts[0]], strict=True):
        s = by_id[rid]
        assert s.num_interrupts == 0
        if rid in in_flight:
            assert s.versions == [0] * 10
            assert s.response_ids == greedy_continuation(old, prompt, 10)
        else:  # admitted after the update
            assert s.versions == [1] * 10
            assert s.response_ids == greedy_continuation(new, prompt, 10)
    st = engine.stats()
    assert st["weight_copies"] == 1 and st["version"] == 1
    assert st["sequences_interrupted"] == 0


def test_non_interrupt_then_interrupt_moves_everyone_to_newest(weights) -> None:
    old, new = weights
    prompts = random_prompts([4, 6, 3], seed=24)
    engine = make_engine(old, max_slots=2)
    params = SamplingParams(greedy=True, max_tokens=8, ignore_eos=True)
    for p in prompts:
        engine.submit(GenerationRequest(p, params))
    engine.step()
    engine.update_weights(new.state_dict(), version=1, interrupt=False)
    engine.step()
    engine.update_weights(old.state_dict(), version=2, interrupt=True)
    assert engine.stats()["weight_copies"] == 1
    out = engine.drain()
    assert len(out) == 3
    for s in out:
        assert s.versions[-1] == 2
        lp = torch.tensor(s.behaviour_logprobs)
        v = torch.tensor(s.versions)
        for version, model in {0: old, 1: new, 2: old}.items():
            sel = v == version
            if sel.any():
                ref = recompute_logprobs(model, s.prompt_ids, s.response_ids)
                torch.testing.assert_close(lp[sel], ref[sel], atol=1e-5, rtol=0)


def test_update_weights_rejects_bad_versions_and_state(weights) -> None:
    old, _ = weights
    engine = make_engine(old, version=3)
    with pytest.raises(ValueError, match="already version 3"):
        engine.update_weights(old.state_dict(), version=3)
    (prompt,) = random_prompts([4], seed=26)
    params = SamplingParams(greedy=True, max_tokens=6)
    engine.submit(GenerationRequest(prompt, params))
    engine.step()
    with pytest.raises(ValueError, match="unexpected keys"):
        engine.update_weights({"nope": torch.zeros(1)}, version=4, interrupt=False)
    bad = dict(old.state_dict())
    name = next(iter(bad))
    bad[name] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights(bad, version=4)
    # A rejected update changes nothing: the request finishes on version 3 as if untouched.
    (s,) = engine.drain()
    assert engine.version == 3 and s.versions == [3] * len(s.response_ids)
    (ref,) = make_engine(old).generate([GenerationRequest(prompt, params)])
    assert s.response_ids == ref.response_ids


def test_stats(weights) -> None:
    old, new = weights
    prompts = random_prompts([4, 6, 3, 5], seed=25)
    engine = make_engine(old, max_slots=2)
    params = SamplingParams(max_tokens=6, ignore_eos=True, seed=0)
    for p in prompts:
        engine.submit(GenerationRequest(p, params))
    engine.step()
    engine.update_weights(new.state_dict(), version=1)
    out = engine.drain()
    st = engine.stats()
    assert st["tokens_generated"] == sum(len(s.response_ids) for s in out) == 24
    assert st["requests_finished"] == 4 and st["requests_submitted"] == 4
    # Prompts once, plus the two interrupted sequences' prompt + 1 token re-prefilled.
    assert st["prefill_tokens"] == sum(map(len, prompts)) + (4 + 1) + (6 + 1)
    assert 0 < st["mean_slot_utilisation"] <= 1
    assert st["steps"] >= 12 and st["forwards"] >= st["steps"]
    assert st["decode_time_s"] > 0 and st["prefill_time_s"] > 0 and st["tokens_per_s"] > 0
    assert st["sequences_interrupted"] == 2 and st["kv_cache_bytes"] > 0
    assert st["num_running"] == st["num_waiting"] == 0
