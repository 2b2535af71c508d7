"""The float32 CPU step's C pieces and the direct path's fused GEMMs give torch's bits:
``varlen_decode.add_rms_norm`` (residual add + LlamaRMSNorm, ATen's sum order),
``Rows.attend`` (rotary + cache writes + attention in one call), ``direct_forward._rotary``'s
signed-sin rotation, and fused projections that follow in-place weight updates."""

from __future__ import annotations

import pytest
import torch

from relayrl.rollout import (
    GenerationRequest,
    RolloutEngine,
    SamplingParams,
    direct_forward,
)
from relayrl.rollout.cpu_kernels import varlen_decode
from rollout_helpers import EOS, PAD, random_prompts, tiny_model

pytestmark = pytest.mark.skipif(
    not varlen_decode.available(), reason=f"no kernel: {varlen_decode.unavailable_reason()}"
)


def _torch_norm(h: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """``LlamaRMSNorm.forward`` in float32, as written there."""
    var = h.pow(2).mean(-1, keepdim=True)
    return w * (h * torch.rsqrt(var + eps))


@pytest.mark.parametrize("dim", [8, 12, 16, 31, 64, 100, 256])
def test_add_rms_norm_is_bitwise_torch(dim: int) -> None:
    lanes = varlen_decode.aten_lanes()
    if not lanes or dim < lanes:
        pytest.skip("ATen's kernels on this machine are not ones the C sum repeats")
    g = torch.Generator().manual_seed(dim)
    w = torch.randn(dim, generator=g)
    for n in (1, 2, 7, 33):
        a = torch.randn(n, dim, generator=g) * 3
        b = torch.randn(n, dim, generator=g)
        h, x = varlen_decode.add_rms_norm(a, b, w, 1e-6, lanes)
        assert torch.equal(h, a + b)
        assert torch.equal(x, _torch_norm(a + b, w, 1e-6))
        same, x0 = varlen_decode.add_rms_norm(a, None, w, 1e-5, lanes)
        assert same is a and torch.equal(x0, _torch_norm(a, w, 1e-5))


def test_add_rms_norm_hand_case_and_bad_input() -> None:
    lanes = varlen_decode.aten_lanes()
    if not lanes:
        pytest.skip("ATen's kernels on this machine are not ones the C sum repeats")
    # a row of eight 2s: mean of squares 4, 1 / sqrt(4 + 0) = 0.5, so x = w * 1
    a = torch.full((1, 8), 2.0)
    w = torch.arange(8, dtype=torch.float32)
    _, x = varlen_decode.add_rms_norm(a, None, w, 0.0, 8)
    assert x.tolist() == [w.tolist()]
    with pytest.raises(ValueError, match="at most 256"):
        varlen_decode.add_rms_norm(torch.zeros(1, 512), None, torch.ones(512), 1e-6, 8)
    with pytest.raises(ValueError, match="contiguous float32"):
        varlen_decode.add_rms_norm(a.double(), None, w.double(), 1e-6, 8)


def test_signed_sin_rotation_is_bitwise_rotate_half() -> None:
    """``x * cos + roll(x, d/2) * sin_signed`` against transformers' ``apply_rotary_pos_emb``
    form ``x * cos + rotate_half(x) * sin``."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, rotate_half

    model = _config()
    rotary = LlamaRotaryEmbedding(model)
    pos = torch.tensor([0, 1, 5, 40, 200])
    cos, sin_signed = direct_forward._rotary(pos, rotary, torch.float32)
    x = torch.randn(5, 4, 16, generator=torch.Generator().manual_seed(2)) * 4
    ref_cos, ref_sin = rotary(x, pos[None])
    want = x * ref_cos[0][:, None] + rotate_half(x) * ref_sin[0][:, None]
    assert torch.equal(direct_forward._rope(x, cos, sin_signed), want)


def _config():  # a Llama config with head_dim 16
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)


def test_attend_is_rotary_writes_and_attention_in_torch() -> None:
    """Rows.attend on column slices of one projection: the arenas get torch's rotated keys
    and the values at each row's column; the output is the kernel on torch's rotated queries;
    a prompt's second token reads the first's key written in the same call."""
    g = torch.Generator().manual_seed(4)
    heads, kv_heads, d, slots, cols = 4, 2, 16, 3, 9
    rows = torch.tensor([2, 0, 0])  # slot 2 decodes at column 5; slot 0 a two-token prompt
    lens = torch.tensor([6, 1, 2])
    keys = torch.randn(slots, kv_heads, cols, d, generator=g)
    values = torch.randn(slots, kv_heads, cols, d, generator=g)
    want_k, want_v = keys.clone(), values.clone()
    proj = torch.randn(3, (heads + 2 * kv_heads) * d, generator=g)
    q, k, v = proj.split([heads * d, kv_heads * d, kv_heads * d], dim=1)
    cos = torch.randn(3, 1, d, generator=g)
    sin = torch.randn(3, 1, d, generator=g)
    out = varlen_decode.Rows(rows, lens, 6).attend(q, k, v, cos, sin, keys, values, 0.25)
    rq = direct_forward._rope(q.reshape(3, heads, d), cos, sin)
    rk = direct_forward._rope(k.reshape(3, kv_heads, d), cos, sin)
    for i in range(3):
        want_k[rows[i], :, lens[i] - 1] = rk[i]
        want_v[rows[i], :, lens[i] - 1] = v[i].view(kv_heads, d)
    assert torch.equal(keys, want_k) and torch.equal(values, want_v)
    ref = varlen_decode.decode_attention(rq.unsqueeze(2), keys, values, rows, lens, 6, 0.25)
    assert torch.equal(out, ref.view(3, heads, d))
    with pytest.raises(ValueError, match="do not fit"):
        varlen_decode.Rows(rows, lens, 6).attend(q[:, :8], k, v, cos, sin, keys, values, 0.25)


def _generate(model: torch.nn.Module, direct: bool, varlen: bool) -> list:
    engine = RolloutEngine(model, eos_token_id=EOS, pad_token_id=PAD, max_slots=3)
    engine.runner.direct, engine.runner.varlen_decode = direct, varlen
    prompts = random_prompts([6, 2, 19, 1, 5], seed=31)
    reqs = [
        GenerationRequest(p, SamplingParams(temperature=0.8, max_tokens=10, seed=i))
        for i, p in enumerate(prompts)
    ]
    return [(s.response_ids, s.behaviour_logprobs) for s in engine.generate(reqs)]


def test_direct_path_is_bitwise_with_sdpa_buckets_too(tmp_path) -> None:
    """With the kernel off (the padded-bucket SDPA route, as on an accelerator) the direct
    path's 2D rows, fused GEMMs and C norms still give the module path's samples exactly."""
    model = tiny_model(tmp_path, "llama")
    assert _generate(model, True, False) == _generate(model, False, False)


def test_fused_projections_follow_in_place_weight_updates(tmp_path) -> None:
    """A fused q/k/v and gate/up copy is rebuilt when a weight changes in place
    (``load_state_dict``, ``copy_``) or its storage is replaced (``.data =``)."""
    model = tiny_model(tmp_path, "llama")
    first = _generate(model, True, True)
    assert direct_forward._FUSED  # the fused path ran
    mlp = model.model.layers[0].mlp
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight.mul_(1.5)
        mlp.up_proj.weight.data = mlp.up_proj.weight.data * -1.0
    after = _generate(model, True, True)
    assert after != first
    assert after == _generate(model, False, True)  # the module path on the new weights


def _sample_both(logits, settings, index, monkeypatch):
    """(C draw, torch ops) on the same rows; the first really went through C, the second
    did not (else the comparison would hold trivially)."""
    from relayrl.rollout import sampler

    calls = []
    real = sampler._draw_c
    monkeypatch.setattr(sampler, "_draw_c", lambda *a: calls.append(1) or real(*a))
    got = sampler.sample(logits, settings, index)
    assert calls == [1]
    monkeypatch.setattr(sampler, "C_DRAW", False)
    want = sampler.sample(logits, settings, index)
    assert calls == [1]
    monkeypatch.setattr(sampler, "C_DRAW", True)
    monkeypatch.setattr(sampler, "_draw_c", real)
    return got, want


@pytest.mark.parametrize("vocab", [1, 2, 7, 90, 1000, 50257])
def test_c_draw_gives_the_torch_samplers_tokens_and_logprobs(vocab, monkeypatch) -> None:
    """``sample_rows_f32`` (float64 running CDF, SplitMix64 uniforms, the upper-bound
    search, the token's float32 logprob; greedy rows' argmax) against the torch ops it
    replaces: equal, row by row, under temperatures and top-k / top-p filters, peaked and
    flat rows, any seed, all-greedy and mixed batches, ties and NaNs."""
    from relayrl.rollout.sampler import SamplingSettings

    g = torch.Generator().manual_seed(vocab)
    calls = []
    for n in (1, 3, 32):
        scale = torch.tensor([0.1, 1.0, 30.0]).repeat(n)[:n].unsqueeze(1)
        logits = torch.randn(n, vocab, generator=g) * scale
        kinds = [
            dict(temperature=1.0, top_k=0, top_p=1.0),
            dict(temperature=0.7, top_k=0, top_p=1.0),
            dict(temperature=1.3, top_k=5, top_p=0.9),
        ]
        greedy = dict(temperature=1.0, top_k=0, top_p=1.0)  # as the engine normalises it
        for kind, every in [(k, None) for k in kinds] + [(greedy, 1), (kinds[2], 2)]:
            seeds = [int(x) for x in torch.randint(-(2**62), 2**62, (n,), generator=g)]
            # every: None = no greedy row, 1 = all greedy, 2 = every other row greedy
            settings = [
                SamplingSettings(
                    greedy=every is not None and i % every == 0,
                    seed=s,
                    **(greedy if every is not None and i % every == 0 else kind),
                )
                for i, s in enumerate(seeds)
            ]
            index = [int(x) for x in torch.randint(0, 5000, (n,), generator=g)]
            calls.append((logits, settings, index))
    # the module path's logits: each sequence's last position, rows strided
    strided = torch.randn(4, 3, vocab, generator=g)[:, -1]
    assert not strided.is_contiguous()
    for every in (1, 2):
        st = [SamplingSettings(greedy=i % every == 0, seed=i, **greedy) for i in range(4)]
        calls.append((strided, st, [7, 8, 9, 10]))
    # greedy rows with ties (the first maximum) and NaNs (the first NaN)
    nan = float("nan")
    ties = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, nan, 5.0, nan], [4.0, 4.0, 4.0, 4.0]])
    ties = ties.repeat_interleave(max(1, vocab // 4), dim=1)[:, :vocab] if vocab >= 4 else None
    if ties is not None:
        for every in (1, 2):
            st = [SamplingSettings(greedy=i % every == 0, seed=i, **greedy) for i in range(3)]
            calls.append((ties, st, [0, 1, 2]))
    for logits, settings, index in calls:
        (tok, lp), (want_tok, want_lp) = _sample_both(logits, settings, index, monkeypatch)
        assert tok == want_tok
        # the same Python floats (the float32 logprobs, widened; NaN where torch has NaN)
        assert [repr(x) for x in lp] == [repr(x) for x in want_lp]


def test_c_draw_hand_case() -> None:
    """Two tokens with probabilities 1/4 and 3/4: the CDF is [0.25, 1.0]; the token is the
    first j with cdf_j > u, so u < 0.25 draws 0 and u >= 0.25 draws 1 (u from SplitMix64)."""
    import math

    from relayrl.rollout.sampler import SamplingSettings, sample, uniform

    logits = torch.tensor([[math.log(0.25), math.log(0.75)]])
    seen = set()
    for seed in range(40):
        s = SamplingSettings(greedy=False, temperature=1.0, top_k=0, top_p=1.0, seed=seed)
        (tok,), (lp,) = sample(logits, [s], [3])
        want = 0 if uniform(seed, 3) < 0.25 else 1
        assert tok == want
        assert lp == pytest.approx(math.log([0.25, 0.75][want]), abs=1e-6)
        seen.add(tok)
    assert seen == {0, 1}


def test_c_draw_follows_torch_on_non_finite_rows(monkeypatch) -> None:
    """NaN and infinite logits (a broken model): the C search makes torch.searchsorted's
    comparisons, so the token and the (NaN) logprob are torch's too."""
    from relayrl.rollout.sampler import SamplingSettings

    nan, inf = float("nan"), float("inf")
    rows = torch.tensor([[nan, 1.0, 2.0], [-inf, -inf, -inf], [0.0, inf, 1.0], [1.0, nan, nan]])
    for r in range(len(rows)):
        s = [SamplingSettings(greedy=False, temperature=1.0, top_k=0, top_p=1.0, seed=r)]
        (tok, lp), (want_tok, want_lp) = _sample_both(rows[r : r + 1], s, [5], monkeypatch)
        assert tok == want_tok and repr(lp) == repr(want_lp)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_the_engine_draws_through_c_on_the_cpu(tmp_path, arch, monkeypatch) -> None:
    """Every step of a float32 CPU engine samples through the C draw (direct path and
    module path logits alike), with the samples the torch ops give."""
    from relayrl.rollout import sampler

    calls = []
    real = sampler._draw_c
    monkeypatch.setattr(sampler, "_draw_c", lambda *a: calls.append(1) or real(*a))
    model = tiny_model(tmp_path, arch)
    got = _generate(model, True, True)
    steps = len(calls)
    assert steps >= 10  # one call per forward: 5 requests x 10 tokens on 3 slots
    monkeypatch.setattr(sampler, "C_DRAW", False)
    assert _generate(model, True, True) == got
    assert len(calls) == steps  # the torch ops ran the second time
