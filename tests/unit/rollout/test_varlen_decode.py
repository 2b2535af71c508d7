"""The CPU varlen decode attention (``rollout.varlen_decode``): the formula by hand, SDPA's
outputs on ragged rows read straight from the arena, the engine's tokens and logprobs with it
and without it, and the fallback when no C compiler is there."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from relayrl.rollout import GenerationRequest, RolloutEngine, SamplingParams
from relayrl.rollout.cpu_kernels import varlen_decode
from relayrl.rollout.split_attention import causal_mask
from rollout_helpers import random_prompts, tiny_model

pytestmark = pytest.mark.skipif(
    not varlen_decode.available(), reason=f"no kernel: {varlen_decode.unavailable_reason()}"
)


def test_one_row_by_hand() -> None:
    # q = [1, 0] against keys [1, 0], [0, 1] (scale 1): scores 1 and 0, weights e/(e+1) and
    # 1/(e+1) on values [1, 2] and [3, 4]; the third column is past the row's length.
    keys = torch.tensor([[[[1.0, 0.0], [0.0, 1.0], [9.0, 9.0]]]])  # [S=1, Hkv=1, C=3, D=2]
    values = torch.tensor([[[[1.0, 2.0], [3.0, 4.0], [9.0, 9.0]]]])
    q = torch.tensor([[[[1.0, 0.0]]]])  # [n=1, H=1, 1, D]
    out = varlen_decode.decode_attention(
        q, keys, values, torch.tensor([0]), torch.tensor([2]), 2, 1.0
    )
    w0, w1 = math.e / (math.e + 1), 1 / (math.e + 1)
    want = torch.tensor([w0 * 1 + w1 * 3, w0 * 2 + w1 * 4])
    assert out.shape == (1, 1, 1, 2)
    torch.testing.assert_close(out[0, 0, 0], want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"), [(4, 2, 16), (4, 4, 16), (8, 1, 64), (6, 3, 20)]
)
def test_equals_sdpa_on_ragged_rows(heads: int, kv_heads: int, dim: int) -> None:
    g = torch.Generator().manual_seed(heads * 100 + dim)
    slots, cols = 7, 41
    keys = torch.randn(slots, kv_heads, cols, dim, generator=g)
    values = torch.randn(slots, kv_heads, cols, dim, generator=g)
    rows = torch.tensor([5, 0, 3, 6, 1])  # not in order, not contiguous
    lens = torch.tensor([1, 41, 17, 2, 30])  # one column .. the whole arena
    n, max_len = len(rows), int(lens.max())
    q = torch.randn(n, heads, 1, dim, generator=g)
    got = varlen_decode.decode_attention(q, keys, values, rows, lens, max_len, dim**-0.5)
    # reference: the rows' padded reads, repeat_kv and a masked SDPA
    k = keys[:, :, :max_len].index_select(0, rows).repeat_interleave(heads // kv_heads, 1)
    v = values[:, :, :max_len].index_select(0, rows).repeat_interleave(heads // kv_heads, 1)
    mask = causal_mask((lens - 1).view(-1, 1, 1), max_len, torch.float32)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)
    assert got.shape == (n, 1, heads, dim)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)


def test_plain_c_path_gives_the_same_bits() -> None:
    """The AVX2 code (where the CPU has it), the SSE2 code and the plain C code
    (``-DRELAYRL_SCALAR``, what a machine without SSE2 runs) sum in one written order: equal
    bits, on every D (a multiple of 4 or not), every row length (a multiple of the 4- and
    8-column blocks or not) and groups of 1, 2, 3 and 8 query heads."""
    plain = varlen_decode._build(("-DRELAYRL_SCALAR",))
    g = torch.Generator().manual_seed(7)
    shapes = [(4, 2, 16), (8, 1, 64), (6, 3, 20), (6, 2, 16), (2, 1, 6), (2, 2, 128)]
    for heads, kv_heads, dim in shapes:
        keys = 3 * torch.randn(5, kv_heads, 70, dim, generator=g)
        values = torch.randn(5, kv_heads, 70, dim, generator=g)
        rows, lens = torch.tensor([4, 0, 2, 1, 3]), torch.tensor([1, 70, 5, 13, 4])
        q = 3 * torch.randn(5, heads, 1, dim, generator=g)
        args = (q, keys, values, rows, lens, 70, dim**-0.5)
        fast = varlen_decode.decode_attention(*args)  # 8-wide where the CPU has AVX2
        assert torch.equal(fast, varlen_decode.decode_attention(*args, library=plain))
        varlen_decode.set_wide_path(False)
        try:
            assert not varlen_decode.wide_path()
            assert torch.equal(fast, varlen_decode.decode_attention(*args))  # SSE2
        finally:
            varlen_decode.set_wide_path(True)


def test_softmax_weights_against_float64_over_a_wide_range() -> None:
    """The kernel's exp is its own polynomial (Cephes expf, exp(x) set to 0 below -87): with
    one-hot values the output is the weights themselves; scores spread from 0 to -200 (far
    past the cut) and near ties agree with float64 softmax to float32 rounding."""
    cols = 64
    values = torch.eye(cols).view(1, 1, cols, cols)  # v_j = e_j: out = the weights
    keys = torch.zeros(1, 1, cols, cols)
    keys[0, 0, :, 0] = torch.cat([torch.linspace(0.0, -200.0, 48), torch.full((16,), -1e-3)])
    q = torch.zeros(1, 1, 1, cols)
    q[0, 0, 0, 0] = 1.0
    for n in (cols, 61, 3):
        got = varlen_decode.decode_attention(
            q, keys, values, torch.tensor([0]), torch.tensor([n]), n, 1.0
        )[0, 0, 0, :n].double()
        want = torch.softmax(keys[0, 0, :n, 0].double(), 0)
        torch.testing.assert_close(got, want, rtol=3e-7, atol=1e-9)
        assert float(got.sum()) == pytest.approx(1.0, abs=1e-6)


def test_rejects_a_read_past_the_arena() -> None:
    keys = torch.zeros(2, 1, 4, 8)
    with pytest.raises(ValueError, match="arena holds 4"):
        varlen_decode.decode_attention(
            torch.zeros(1, 1, 1, 8), keys, keys, torch.tensor([0]), torch.tensor([5]), 5, 1.0
        )


def test_rejects_bad_inputs_and_ignores_the_default_device() -> None:
    keys = torch.randn(2, 1, 4, 8)
    q = torch.randn(1, 1, 1, 8)
    with pytest.raises(ValueError, match="lens must be"):
        varlen_decode.decode_attention(
            q, keys, keys, torch.tensor([0]), torch.tensor([1.0]), 1, 1.0
        )
    want = varlen_decode.decode_attention(
        q, keys, keys, torch.tensor([1]), torch.tensor([3]), 3, 1.0
    )
    with torch.device("meta"):  # a caller's default device: the outputs stay on the CPU
        got = varlen_decode.decode_attention(
            q, keys, keys, torch.tensor([1], device="cpu"), torch.tensor([3], device="cpu"), 3, 1.0
        )
    assert got.device.type == "cpu" and torch.equal(got, want)


def _run(model, varlen: bool, requests) -> list:
    engine = RolloutEngine(model, eos_token_id=2, pad_token_id=0, max_slots=4, max_model_len=96)
    engine.runner.varlen_decode = varlen
    engine.runner.bucket_min_len, engine.runner.bucket_overhead = 2, 1  # buckets when off
    calls = {"n": 0}
    real = varlen_decode.decode_attention

    def counting(*a):
        calls["n"] += 1
        return real(*a)

    varlen_decode.decode_attention = counting
    try:
        for r in requests:
            engine.submit(r)
        done = sorted(engine.drain(), key=lambda s: s.request_id)  # ids in submit order
    finally:
        varlen_decode.decode_attention = real
    assert (calls["n"] > 0) == varlen
    return done


def test_engine_gives_the_same_tokens_with_and_without_it(tmp_path) -> None:
    """Ragged rows (short answers next to long ones, admissions between): the same greedy
    tokens and behaviour logprobs as the bucketed SDPA path."""
    model = tiny_model(tmp_path, "llama")
    lengths = [1, 40, 3, 17, 60, 2, 9]
    prompts = random_prompts([5, 12, 8, 20, 6, 9, 14], seed=3)

    def requests():
        return [
            GenerationRequest(p, SamplingParams(max_tokens=t, ignore_eos=True, temperature=0.0))
            for p, t in zip(prompts, lengths, strict=True)
        ]

    on, off = _run(model, True, requests()), _run(model, False, requests())
    for a, b in zip(on, off, strict=True):
        assert len(a.response_ids) == len(b.response_ids) > 0
        assert a.response_ids == b.response_ids
        torch.testing.assert_close(
            torch.tensor(a.behaviour_logprobs),
            torch.tensor(b.behaviour_logprobs),
            rtol=0,
            atol=1e-5,
        )


def test_no_compiler_means_sdpa_and_a_reason(tmp_path) -> None:
    code = (
        "from relayrl.rollout.cpu_kernels import varlen_decode as v\n"
        "print(v.available(), v.unavailable_reason())\n"
    )
    env = {**os.environ, "CC": "no-such-cc", "RELAYRL_CACHE_DIR": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert out.startswith("False") and "no-such-cc" in out, out


def _mixed_step(model, varlen: bool, monkeypatch) -> tuple[torch.Tensor, torch.Tensor, list, int]:
    """Three prompts prefilled, then a step of their three decode rows and two fresh prompts;
    returns its logits, the new prompts' layer-0 keys, the kernel's row counts and how many
    prefill-attention calls ran, in that step."""
    from relayrl.rollout import split_attention
    from relayrl.rollout.kv_cache import SlotKVCache
    from relayrl.rollout.model_runner import ModelRunner

    runner, cache = ModelRunner(0, 6, varlen_decode=varlen), SlotKVCache(6, 64)
    rows_seen: list[int] = []
    prefill_calls = [0]
    real_prefill = split_attention.prefill_attention
    real_call, real_attend = varlen_decode.Rows.__call__, varlen_decode.Rows.attend

    def kernel(self, query, *a):  # the module path's calls of the kernel
        rows_seen.append(query.shape[0])
        return real_call(self, query, *a)

    def attend(self, query, *a):  # the direct path's (rotary and cache writes in C too)
        rows_seen.append(query.shape[0])
        return real_attend(self, query, *a)

    def prefill(*a):
        prefill_calls[0] += 1
        return real_prefill(*a)

    monkeypatch.setattr(varlen_decode.Rows, "__call__", kernel)
    monkeypatch.setattr(varlen_decode.Rows, "attend", attend)
    monkeypatch.setattr(split_attention, "prefill_attention", prefill)
    first, later = random_prompts([7, 11, 4], seed=5), random_prompts([9, 13], seed=6)
    with torch.inference_mode():
        runner.execute(model, cache, [0, 1, 2], [0, 0, 0], first)
        rows_seen.clear()
        prefill_calls[0] = 0
        logits = runner.execute(
            model, cache, [0, 1, 2, 3, 4], [7, 11, 4, 0, 0], [[5], [6], [7]] + later
        )
    monkeypatch.undo()
    return logits, cache._keys[0][3:5, :, :13].clone(), rows_seen, prefill_calls[0]


def test_prompts_go_through_the_kernel_too(tmp_path, monkeypatch) -> None:
    """A step with decode rows and two fresh prompts: with the kernel every token of the step
    (each prompt token reading its slot's columns 0 .. its position) is one kernel row, no
    prefill mask and no per-prompt call; the logits equal the SDPA path's (masked prefill) to
    float32 rounding, and the prompts' keys land in the same cache columns."""
    model = tiny_model(tmp_path, "llama")
    logits, keys, rows, prefills = _mixed_step(model, True, monkeypatch)
    assert rows == [3 + 9 + 13] * model.config.num_hidden_layers and prefills == 0
    want_logits, want_keys, rows_off, prefills_off = _mixed_step(model, False, monkeypatch)
    assert rows_off == [] and prefills_off > 0
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=1e-5)
    assert torch.equal(keys, want_keys)
