"""Logprobs and entropy from logits: hand cases, chunking, dtypes, -inf logits."""

import math

import pytest
import torch

from relayrl.algos import entropy_from_logits, logprobs_from_logits

D = torch.float64


def test_logprobs_hand_case() -> None:
    # logits [0, ln 3] -> softmax [1/4, 3/4]: logprob(token 0) = ln 1/4, logprob(1) = ln 3/4
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]], dtype=D)
    out = logprobs_from_logits(logits, torch.tensor([[0, 1]]))
    assert out[0].tolist() == pytest.approx([math.log(0.25), math.log(0.75)])
    # temperature 2: logits [0, ln 3 / 2] -> softmax [1/(1+sqrt3), sqrt3/(1+sqrt3)]
    hot = logprobs_from_logits(logits, torch.tensor([[0, 1]]), temperature=2.0)
    s3 = math.sqrt(3.0)
    assert hot[0].tolist() == pytest.approx([-math.log(1 + s3), math.log(s3 / (1 + s3))])


def test_logprobs_match_log_softmax_any_chunking_and_upcast_bf16() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g, dtype=D, requires_grad=True)
    ids = torch.randint(0, 11, (3, 5), generator=g)
    ref = torch.log_softmax(logits, -1).gather(-1, ids[..., None]).squeeze(-1)
    (ref_grad,) = torch.autograd.grad(ref.sum(), logits)
    for chunk in (1, 4, 15, 1024):
        out = logprobs_from_logits(logits, ids, chunk_size=chunk)
        assert torch.allclose(out, ref, atol=1e-12)
        (grad,) = torch.autograd.grad(out.sum(), logits)
        assert torch.allclose(grad, ref_grad, atol=1e-12)
    low = logits.detach().to(torch.bfloat16)
    out16 = logprobs_from_logits(low, ids, chunk_size=4)
    assert out16.dtype == torch.float32
    ref16 = torch.log_softmax(low.float(), -1).gather(-1, ids[..., None]).squeeze(-1)
    assert torch.allclose(out16, ref16, atol=1e-6)
    with pytest.raises(ValueError, match="token_ids"):
        logprobs_from_logits(logits, ids[:, :3])


def test_entropy_hand_case() -> None:
    # uniform over 4 -> ln 4; [0, ln 3] -> p = [1/4, 3/4] -> -(1/4 ln 1/4 + 3/4 ln 3/4);
    # [0, -inf, -inf, -inf] -> a point mass -> 0 (and no NaN from -inf * 0)
    logits = torch.tensor(
        [
            [
                [0.0, 0, 0, 0],
                [0.0, math.log(3.0), -math.inf, -math.inf],
                [0.0, -math.inf, -math.inf, -math.inf],
            ]
        ],
        dtype=D,
        requires_grad=True,
    )
    h = entropy_from_logits(logits)
    expected = [math.log(4.0), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), 0.0]
    assert h[0].tolist() == pytest.approx(expected)
    h.sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_entropy_matches_categorical_any_chunking() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 7, 13, generator=g, dtype=D) * 4
    ref = torch.distributions.Categorical(logits=logits).entropy()
    for chunk in (1, 3, 14, 1024):
        assert torch.allclose(entropy_from_logits(logits, chunk_size=chunk), ref, atol=1e-12)
    low = entropy_from_logits(logits.to(torch.bfloat16), chunk_size=5)
    assert low.dtype == torch.float32 and low.shape == (2, 7)
    with pytest.raises(ValueError, match="chunk_size"):
        entropy_from_logits(logits, chunk_size=0)
