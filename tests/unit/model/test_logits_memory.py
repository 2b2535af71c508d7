"""``forward_logprobs`` at a large vocabulary (issue 38): the LM head runs on the response
positions only (``logits_to_keep``), logprobs and entropy are chunked, the entropy's softmax is
recomputed in the backward; values and gradients equal the whole-sequence computation."""

from __future__ import annotations

import pytest
import torch

from relayrl.algos import entropy_from_logits, logprobs_from_logits
from relayrl.model import forward_logprobs, load_causal_lm, pack_batch
from relayrl.model.batching import LOGIT_CHUNK_ROWS, _entropy_low_memory, keeps_logits
from relayrl.model.tiny import build_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    return load_causal_lm(build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=3))


def _batch() -> object:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 40, (n,), generator=g).tolist() for n in (7, 3, 11)]
    responses = [torch.randint(3, 40, (n,), generator=g).tolist() for n in (5, 2, 4)]
    return pack_batch(prompts, responses, pad_id=0)


def _reference(model: torch.nn.Module, batch, temperature: float):  # type: ignore[no-untyped-def]
    """The whole-sequence logits, sliced at the response positions (the old computation)."""
    out = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        use_cache=False,
    )
    p, r = batch.prompt_width, batch.response_ids.shape[1]
    logits = out.logits[:, p - 1 : p - 1 + r].float() / temperature
    return logprobs_from_logits(logits, batch.response_ids), entropy_from_logits(logits)


def test_lm_head_sees_only_the_response_positions(tiny: torch.nn.Module) -> None:
    batch = _batch()
    shapes: list[tuple[int, ...]] = []
    hook = tiny.get_output_embeddings().register_forward_hook(
        lambda _m, _i, out: shapes.append(tuple(out.shape))
    )
    try:
        logp, ent = forward_logprobs(tiny, batch, temperature=0.7, with_entropy=True)
    finally:
        hook.remove()
    r = batch.response_ids.shape[1]
    assert keeps_logits(tiny)
    assert shapes == [(3, r + 1, tiny.config.vocab_size)]  # not P + R positions
    ref_lp, ref_ent = _reference(tiny, batch, 0.7)
    torch.testing.assert_close(logp, ref_lp, rtol=1e-5, atol=1e-5)
    assert ent is not None
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)


def test_gradients_equal_the_whole_sequence_computation(tiny: torch.nn.Module) -> None:
    batch = _batch()
    mask = batch.response_mask
    logp, ent = forward_logprobs(tiny, batch, with_entropy=True)
    assert ent is not None
    ((logp * mask).sum() + 0.1 * (ent * mask).sum()).backward()
    got = [p.grad.clone() for p in tiny.parameters()]
    tiny.zero_grad()
    ref_lp, ref_ent = _reference(tiny, batch, 1.0)
    ((ref_lp * mask).sum() + 0.1 * (ref_ent * mask).sum()).backward()
    for g, p in zip(got, tiny.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-6)
    tiny.zero_grad()


def test_checkpointed_entropy_over_several_chunks() -> None:
    rows = 2 * LOGIT_CHUNK_ROWS + 17
    logits = torch.randn(rows, 300, dtype=torch.float64)
    logits[0, :5] = float("-inf")  # banned tokens stay NaN-free
    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    ea = _entropy_low_memory(a.view(1, rows, 300), 0.9)
    eb = entropy_from_logits(b.view(1, rows, 300), temperature=0.9)
    torch.testing.assert_close(ea, eb)
    (ea * torch.arange(rows)).sum().backward()
    (eb * torch.arange(rows)).sum().backward()
    torch.testing.assert_close(a.grad, b.grad)
    assert not torch.isnan(a.grad).any()


class _NoKeep(torch.nn.Module):
    """A causal LM whose forward has no ``logits_to_keep`` (older or custom models)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, attention_mask, position_ids, use_cache=False):  # type: ignore[no-untyped-def]
        return self.inner(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=use_cache,
        )


def test_models_without_logits_to_keep_use_the_whole_sequence(tiny: torch.nn.Module) -> None:
    batch = _batch()
    wrapped = _NoKeep(tiny)
    assert not keeps_logits(wrapped)
    logp, _ = forward_logprobs(wrapped, batch)
    ref_lp, _ = _reference(tiny, batch, 1.0)
    torch.testing.assert_close(logp, ref_lp, rtol=1e-5, atol=1e-5)
