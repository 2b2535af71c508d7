"""Top-k logprobs through the real ``tinker`` SDK: ``topk_prompt_logprobs`` and
``topk_sample_logprobs`` against a plain forward of the sampler's weights (log_softmax of the
model's logits), their order and ties, and what is refused (k out of range,
``prompt_alt_tokens_k``). Both fields were refused with a 400 before.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
import torch  # noqa: E402
from tinker import types  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from relayrl.model import build_tiny_model  # noqa: E402
from relayrl.tinker.server import TinkerServer  # noqa: E402
from relayrl.tinker.service import TinkerService  # noqa: E402
from relayrl.tinker.topk import EMPTY_LOGPROB, check_k, dense, ordered, top_rows  # noqa: E402

KEY = "tml-relayrl-test"
TOKENS = [5, 6, 14, 7, 18, 5, 9, 30, 41]
CONTEXT = 64


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Path, Path]]:
    root = tmp_path_factory.mktemp("tinker-topk")
    base = build_tiny_model(root / "base", hidden_size=32, max_position_embeddings=CONTEXT)
    server = TinkerServer(TinkerService([base], root / "state", seed=0))
    client = tinker.ServiceClient(base_url=server.start(), api_key=KEY)
    yield client, base, root / "state"
    client.close("success").result(timeout=60)
    server.stop()


def _logp(model_dir: Path, tokens: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / temperature) of a plain fp32 forward: row i is the distribution of
    token i + 1."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0].float()
    return torch.log_softmax(logits / temperature, dim=-1)


def _check_rows(rows: list[Any], logp: torch.Tensor, k: int) -> None:
    """Each row: the k largest of its logp row (ids exactly, logprobs within 1e-5), descending,
    their probabilities summing to at most 1."""
    assert len(rows) == len(logp)
    for row, ref in zip(rows, logp, strict=True):
        assert row is not None and len(row) == k
        ids = [t for t, _ in row]
        values = np.array([v for _, v in row])
        best = ref.topk(k)
        assert ids == best.indices.tolist()
        np.testing.assert_allclose(values, best.values.numpy(), atol=1e-5)
        np.testing.assert_allclose(values, ref[ids].numpy(), atol=1e-5)
        assert np.all(np.diff(values) <= 0)
        assert np.exp(values).sum() <= 1 + 1e-5


# --------------------------------------------------------------- by hand (no service)
def test_top_rows_order_and_ties_by_hand() -> None:
    """Descending logprob, equal logprobs by ascending id, also across the k-th place:
    row [0, -1, 0, -2, 0] (ids 0, 2, 4 tie at 0) keeps ids 0 and 2 for k = 2, and
    [-3, -1, -2] orders as ids 1, 2, 0; k above the vocabulary gives the whole row."""
    logp = torch.tensor([[0.0, -1.0, 0.0, -2.0, 0.0], [-3.0, -1.0, -2.0, -9.0, -9.0]])
    values, ids = top_rows(logp, 2)
    assert ids.tolist() == [[0, 2], [1, 2]]
    assert values.tolist() == [[0.0, 0.0], [-1.0, -2.0]]
    values, ids = top_rows(logp, 4)
    assert ids.tolist() == [[0, 2, 4, 1], [1, 2, 0, 3]]
    assert values.tolist() == [[0.0, 0.0, 0.0, -1.0], [-1.0, -2.0, -3.0, -9.0]]
    values, ids = top_rows(logp[1:], 9)
    assert ids.tolist() == [[1, 2, 0, 3, 4]]
    assert ordered([(7, -2.0), (3, -1.0), (5, -2.0)]) == [(3, -1.0), (5, -2.0), (7, -2.0)]


def test_dense_fills_empty_cells_as_the_sdk_reads_them() -> None:
    ids, lps = dense([None, [(4, -0.5)], [(2, -0.25), (3, -0.75)]], 2)
    assert ids.tolist() == [[0, 0], [4, 0], [2, 3]]
    assert lps.tolist() == [[EMPTY_LOGPROB] * 2, [-0.5, EMPTY_LOGPROB], [-0.25, -0.75]]
    from tinker.types.topk_logprobs import TopkLogprobs, topk_to_lists

    rows = topk_to_lists(TopkLogprobs(ids, lps))
    assert rows[0] is None and rows[1] == [(4, -0.5)]
    assert [t for t, _ in rows[2]] == [2, 3]
    assert check_k("k", 0) is None and check_k("k", 20) is None
    assert all(check_k("k", v) for v in (21, -1, 2.0, True, "3"))


# --------------------------------------------------------------- through the SDK
def test_topk_prompt_logprobs_equal_a_plain_forward(served: Any) -> None:
    """Row i >= 1: the top k of log_softmax(logits[i - 1]) at temperature 1 (the request's
    temperature does not apply to the prompt); row 0 None; the prompt token's own logprob
    equals its entry where it is in the top k."""
    client, base, _ = served
    sampler = client.create_sampling_client(base_model=str(base)).result()
    prompt = types.ModelInput.from_ints(TOKENS)
    params = types.SamplingParams(max_tokens=3, temperature=0.7, seed=1, stop=[])
    ref = _logp(base, TOKENS)[:-1]
    for k in (1, 5, 20):
        out = sampler.sample(
            prompt, 1, params, include_prompt_logprobs=True, topk_prompt_logprobs=k
        ).result()
        rows = out.topk_prompt_logprobs
        assert rows is not None and len(rows) == len(TOKENS) and rows[0] is None
        _check_rows(rows[1:], ref, k)
        plp = out.prompt_logprobs
        assert plp is not None and plp[0] is None
        found = 0
        for i in range(1, len(TOKENS)):
            entry = dict(rows[i]).get(TOKENS[i])
            if entry is not None:
                found += 1
                assert plp[i] == pytest.approx(entry, abs=1e-6)
        if k == 20:
            assert found > 0  # the check above ran
    # without include_prompt_logprobs: the rows, no prompt logprobs
    out = sampler.sample(prompt, 1, params, topk_prompt_logprobs=3).result()
    assert out.prompt_logprobs is None and out.sequences[0].topk_logprobs is None
    _check_rows(out.topk_prompt_logprobs[1:], ref, 3)
    # prompt_logprobs_last_n applies to the rows too
    tail = sampler.sample(
        prompt,
        1,
        params,
        include_prompt_logprobs=True,
        topk_prompt_logprobs=3,
        prompt_logprobs_last_n=2,
    ).result()
    assert tail.topk_prompt_logprobs[:-2] == [None] * (len(TOKENS) - 2)
    _check_rows(tail.topk_prompt_logprobs[-2:], ref[-2:], 3)


def test_topk_follow_the_samplers_weights(served: Any) -> None:
    """A sampler on trained weights (a saved sampler checkpoint) serves that checkpoint's
    distribution, not the base's."""
    client, base, state = served
    tc = client.create_lora_training_client(base_model=str(base), rank=0).result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS[:-1]),
        loss_fn_inputs={"target_tokens": TOKENS[1:]},
    )
    for _ in range(3):
        tc.forward_backward([datum], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=0.05)).result()
    path = tc.save_weights_for_sampler("topk").result().path
    sampler = client.create_sampling_client(model_path=path).result()
    out = sampler.sample(
        types.ModelInput.from_ints(TOKENS),
        1,
        types.SamplingParams(max_tokens=1),
        topk_prompt_logprobs=4,
    ).result()
    trained = _logp(state / tc.model_id / "sampler_weights" / "topk", TOKENS)[:-1]
    _check_rows(out.topk_prompt_logprobs[1:], trained, 4)
    base_top = _logp(base, TOKENS)[:-1].topk(4).values.numpy()
    got = np.array([[v for _, v in r] for r in out.topk_prompt_logprobs[1:]])
    assert np.abs(got - base_top).max() > 1e-3


@pytest.mark.parametrize("temperature", [1.0, 0.5, 0.0])
def test_topk_sample_logprobs_equal_a_plain_forward(served: Any, temperature: float) -> None:
    """Each sampled token's row: the top k of the distribution it was drawn from,
    log_softmax(logits / temperature) (greedy: temperature 1) of a plain forward of prompt +
    sampled tokens; the sampled token's logprob equals its entry where it is in the top k."""
    client, base, _ = served
    sampler = client.create_sampling_client(base_model=str(base)).result()
    params = types.SamplingParams(max_tokens=6, temperature=temperature, seed=3, stop=[])
    k = 6
    out = sampler.sample(
        types.ModelInput.from_ints(TOKENS), 3, params, topk_sample_logprobs=k
    ).result()
    assert out.topk_prompt_logprobs is None
    found = 0
    for seq in out.sequences:
        rows = seq.topk_logprobs
        assert rows is not None and len(rows) == len(seq.tokens) == 6
        full = TOKENS + seq.tokens
        ref = _logp(base, full, temperature if temperature > 0 else 1.0)
        _check_rows(rows, ref[len(TOKENS) - 1 : -1], k)
        for row, token, lp in zip(rows, seq.tokens, seq.logprobs, strict=True):
            entry = dict(row).get(token)
            if entry is not None:
                found += 1
                assert lp == pytest.approx(entry, abs=1e-6)
    assert found > 0


def test_filtered_tokens_are_left_out_of_sampled_rows(served: Any) -> None:
    """With top_k = 3 a sampled row holds the 3 tokens left, at their renormalised logprobs
    log_softmax over those 3 logits (fewer than the k = 6 asked)."""
    client, base, _ = served
    sampler = client.create_sampling_client(base_model=str(base)).result()
    params = types.SamplingParams(max_tokens=4, temperature=1.0, top_k=3, seed=2, stop=[])
    out = sampler.sample(
        types.ModelInput.from_ints(TOKENS), 1, params, topk_sample_logprobs=6
    ).result()
    seq = out.sequences[0]
    ref = _logp(base, TOKENS + seq.tokens)[len(TOKENS) - 1 : -1]
    for row, full, token, lp in zip(seq.topk_logprobs, ref, seq.tokens, seq.logprobs, strict=True):
        best = full.topk(3)
        kept = torch.log_softmax(best.values, dim=-1)
        assert [t for t, _ in row] == best.indices.tolist()
        np.testing.assert_allclose([v for _, v in row], kept.numpy(), atol=1e-5)
        assert dict(row)[token] == pytest.approx(lp, abs=1e-6)


def test_topk_on_a_prompt_that_fills_the_context(served: Any) -> None:
    """Top-k prompt rows alone ask for the prompt's forward: a prompt as long as the context
    is served (empty sequences), as with include_prompt_logprobs."""
    client, base, _ = served
    sampler = client.create_sampling_client(base_model=str(base)).result()
    tokens = [5 + i % 40 for i in range(CONTEXT)]
    out = sampler.sample(
        types.ModelInput.from_ints(tokens),
        2,
        types.SamplingParams(max_tokens=4),
        topk_prompt_logprobs=2,
        topk_sample_logprobs=2,
    ).result()
    assert [s.tokens for s in out.sequences] == [[], []]
    assert [s.topk_logprobs for s in out.sequences] == [None, None]  # the SDK's for 0 rows
    _check_rows(out.topk_prompt_logprobs[1:], _logp(base, tokens)[:-1], 2)


def test_k_out_of_range_and_prompt_alt_tokens_are_refused(served: Any) -> None:
    client, base, _ = served
    sampler = client.create_sampling_client(base_model=str(base)).result()
    prompt = types.ModelInput.from_ints(TOKENS)
    params = types.SamplingParams(max_tokens=2)
    for name in ("topk_prompt_logprobs", "topk_sample_logprobs"):
        for k in (21, -1):
            with pytest.raises(tinker.BadRequestError, match=rf"{name} must be .*\[0, 20\]"):
                sampler.sample(prompt, 1, params, **{name: k}).result()
    with pytest.raises(tinker.BadRequestError, match="prompt_alt_tokens_k is not supported"):
        sampler.sample(prompt, 1, params, prompt_alt_tokens_k=2).result()
