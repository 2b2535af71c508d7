"""relayrl's Tinker service, through the real ``tinker`` SDK: the optimizer step against
hand computation, top-K cross_entropy, prompt_logprobs_last_n, a sampler checkpoint saved
again under its name, and what the service must refuse (non-finite loss inputs and gradients,
AdamParams out of range, inputs a loss does not read, negative temperatures, non-text prompt
chunks) instead of silently training on it or answering something the SDK cannot read.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
import torch  # noqa: E402
from tinker import types  # noqa: E402

from relayrl.model import build_tiny_model  # noqa: E402
from relayrl.tinker.server import TinkerServer  # noqa: E402
from relayrl.tinker.service import TinkerService  # noqa: E402

KEY = "tml-relayrl-test"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Path, TinkerServer]]:
    root = tmp_path_factory.mktemp("tinker-numbers")
    base = build_tiny_model(root / "base", hidden_size=32, max_position_embeddings=64)
    server = TinkerServer(TinkerService([base], root / "state", seed=0))
    client = tinker.ServiceClient(base_url=server.start(), api_key=KEY)
    yield client, base, server
    client.close("success").result(timeout=60)
    server.stop()


def _datum(tokens: list[int], **inputs: list[float]) -> Any:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], **inputs},
    )


def _logprobs(tc: Any, tokens: list[int]) -> np.ndarray:
    out = tc.forward([_datum(tokens)], "cross_entropy").result()
    return np.asarray(out.loss_fn_outputs[0]["logprobs"].to_numpy())


TOKENS = [5, 6, 14, 7, 18, 5, 9]


def test_first_adamw_step_matches_the_hand_formula(served: Any) -> None:
    """Full-parameter training, one weighted cross_entropy call, one step. At t = 1 Adam's
    bias-corrected m / sqrt(v) is g / |g|, so p1 = p0 (1 - lr wd) - lr g / (|g| + eps); the
    reported grad_norm is the global L2 norm of g = d(-sum(w lp)) / dp."""
    client, base, server = served
    tc = client.create_lora_training_client(base_model=str(base), rank=0).result()
    weights = [1.0, 0.5, 0.0, 1.0, 1.0, 2.0]
    ref = copy.deepcopy(server.service.bases[str(base.resolve())].weights)
    for p in ref.parameters():
        p.requires_grad_(True)
    logits = ref(input_ids=torch.tensor([TOKENS[:-1]])).logits[0].float()
    lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(TOKENS[1:])[:, None])[:, 0]
    (-(torch.tensor(weights) * lp).sum()).backward()
    grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()])))

    tc.forward_backward([_datum(TOKENS, weights=weights)], "cross_entropy").result()
    lr, wd = 1e-2, 0.1
    step = tc.optim_step(types.AdamParams(learning_rate=lr, weight_decay=wd)).result()
    assert step.metrics["grad_norm"] == pytest.approx(norm, rel=1e-5)
    trained = dict(server.service.models[tc.model_id].module.named_parameters())
    for name, p in ref.named_parameters():
        g = grads.get(name, torch.zeros_like(p))
        expected = p.detach() * (1 - lr * wd) - lr * g / (g.abs() + 1e-12)
        torch.testing.assert_close(trained[name].detach(), expected, atol=1e-6, rtol=0)


def test_non_finite_loss_inputs_are_refused(served: Any) -> None:
    client, base, _ = served
    tc = client.create_lora_training_client(base_model=str(base), rank=4).result()
    n = len(TOKENS) - 1
    bad = _datum(TOKENS, logprobs=[-1.0] * n, advantages=[float("nan")] + [1.0] * (n - 1))
    with pytest.raises(tinker.RequestFailedError, match=r"advantages.*non-finite"):
        tc.forward_backward([bad], "importance_sampling").result()
    inf_w = _datum(TOKENS, weights=[float("inf")] * n)
    with pytest.raises(tinker.RequestFailedError, match=r"weights.*non-finite"):
        tc.forward_backward([inf_w], "cross_entropy").result()
    # nothing was accumulated: the step has no gradient
    assert tc.optim_step(types.AdamParams()).result().metrics["grad_norm"] == 0.0


def test_a_step_on_non_finite_gradients_is_refused_and_changes_nothing(served: Any) -> None:
    """Finite inputs whose ratio overflows float32 (exp(lp - q) with q = -200) give infinite
    gradients: the step is refused with a message (it used to answer grad_norm NaN, which
    the SDK could not parse, after making every weight NaN), the weights stay, and the
    gradients are cleared so the next step trains normally."""
    client, base, _ = served
    tc = client.create_lora_training_client(base_model=str(base), rank=4, seed=2).result()
    n = len(TOKENS) - 1
    blowup = _datum(TOKENS, logprobs=[-200.0] * n, advantages=[1.0] * n)
    tc.forward_backward([blowup], "importance_sampling").result()
    before = _logprobs(tc, TOKENS)
    with pytest.raises(tinker.RequestFailedError, match="not finite"):
        tc.optim_step(types.AdamParams(learning_rate=0.05)).result()
    np.testing.assert_array_equal(_logprobs(tc, TOKENS), before)
    tc.forward_backward([_datum(TOKENS)], "cross_entropy").result()
    step = tc.optim_step(types.AdamParams(learning_rate=0.05)).result()
    assert np.isfinite(step.metrics["grad_norm"]) and step.metrics["accumulated_calls"] == 1.0
    after = _logprobs(tc, TOKENS)
    assert np.isfinite(after).all() and after.sum() > before.sum()


@pytest.mark.parametrize(
    ("field", "value"),
    [("learning_rate", -1e-3), ("beta1", 1.5), ("beta2", 1.0), ("eps", -1.0),
     ("weight_decay", float("nan")), ("grad_clip_norm", -1.0)],
)  # fmt: skip
def test_adam_params_out_of_range_are_refused(served: Any, field: str, value: float) -> None:
    client, base, _ = served
    tc = client.create_lora_training_client(base_model=str(base), rank=2).result()
    tc.forward_backward([_datum(TOKENS)], "cross_entropy").result()
    before = _logprobs(tc, TOKENS)
    params = types.AdamParams(**{field: value})
    with pytest.raises(tinker.RequestFailedError, match=f"AdamParams.{field}"):
        tc.optim_step(params).result()
    np.testing.assert_array_equal(_logprobs(tc, TOKENS), before)


def test_negative_temperature_and_non_text_prompts_are_refused(served: Any) -> None:
    client, base, _ = served
    sampler = client.create_sampling_client(base_model=str(base)).result()
    prompt = types.ModelInput.from_ints([5, 6, 14])
    for params, match in [
        (types.SamplingParams(max_tokens=4, temperature=-1.0), "temperature"),
        (types.SamplingParams(max_tokens=4, top_k=-2), "top_k"),
    ]:
        with pytest.raises(tinker.RequestFailedError, match=match):
            sampler.sample(prompt, 1, params).result()
    image = types.ModelInput(
        chunks=[
            types.EncodedTextChunk(tokens=[5, 6]),
            types.ImageChunk(data=b"\x89PNG", format="png"),
        ]
    )
    with pytest.raises(tinker.APIStatusError, match="image chunks are not supported"):
        sampler.sample(image, 1, types.SamplingParams(max_tokens=2)).result()
    with pytest.raises(tinker.APIStatusError, match="image chunks are not supported"):
        sampler.compute_logprobs(image).result()


def test_top_k_cross_entropy_through_the_sdk(served: Any) -> None:
    """[N, K] target_tokens / weights (the cookbook's top-K distillation): logprobs come back
    [N, K], each column equal to a 1-D forward on that column's targets, and loss:sum =
    -sum(w * lp); datums with different K in one call keep their own shapes. (Was refused.)"""
    client, base, _ = served
    tc = client.create_lora_training_client(base_model=str(base), rank=4, seed=4).result()
    inp = TOKENS[:-1]
    n = len(inp)
    cols = [TOKENS[1:], [3] * n, [40 + i for i in range(n)]]
    single = [
        tc.forward([types.Datum(model_input=types.ModelInput.from_ints(inp),
                                loss_fn_inputs={"target_tokens": c})], "cross_entropy")
        .result().loss_fn_outputs[0]["logprobs"].to_numpy()
        for c in cols
    ]  # fmt: skip
    rng = np.random.default_rng(0)
    w3 = rng.uniform(0, 1, (n, 3)).astype(np.float32)
    tgt3 = torch.tensor(np.stack(cols, axis=1))
    tgt2 = torch.tensor(np.stack(cols[:2], axis=1))
    data = [
        types.Datum(model_input=types.ModelInput.from_ints(inp),
                    loss_fn_inputs={"target_tokens": tgt3, "weights": torch.tensor(w3)}),
        types.Datum(model_input=types.ModelInput.from_ints(inp),
                    loss_fn_inputs={"target_tokens": tgt2, "weights": torch.ones(n, 2)}),
    ]  # fmt: skip
    out = tc.forward(data, "cross_entropy").result()
    lp3 = out.loss_fn_outputs[0]["logprobs"].to_numpy()
    lp2 = out.loss_fn_outputs[1]["logprobs"].to_numpy()
    assert lp3.shape == (n, 3) and lp2.shape == (n, 2)
    np.testing.assert_allclose(lp3, np.stack(single, axis=1), atol=1e-5)
    np.testing.assert_allclose(lp2, np.stack(single[:2], axis=1), atol=1e-5)
    expected = -(w3 * lp3).sum() - lp2.sum()
    assert out.metrics["loss:sum"] == pytest.approx(float(expected), rel=1e-5)
    res = tc.forward_backward(data, "cross_entropy").result()
    assert res.metrics["loss:sum"] == pytest.approx(float(expected), rel=1e-5)
    assert tc.optim_step(types.AdamParams(learning_rate=0.01)).result().metrics["grad_norm"] > 0


def test_inputs_the_loss_ignores_are_refused(served: Any) -> None:
    """Per-token clip thresholds in loss_fn_inputs used to be dropped silently (the config's
    0.8 / 1.2 applied)."""
    client, base, _ = served
    tc = client.create_lora_training_client(base_model=str(base), rank=2).result()
    n = len(TOKENS) - 1
    d = _datum(TOKENS, logprobs=[-1.0] * n, advantages=[1.0] * n,
               clip_low_threshold=[0.99] * n, clip_high_threshold=[1.01] * n)  # fmt: skip
    with pytest.raises(tinker.RequestFailedError, match="clip_high_threshold.*loss_fn_config"):
        tc.forward([d], "ppo").result()


def test_prompt_logprobs_last_n(served: Any) -> None:
    """compute_logprobs(prompt, prompt_logprobs_last_n=n) scores the last n tokens only
    (the SDK raised on the whole-prompt answer relayrl used to give); n outside
    1..len(prompt) - 1 is a user error (was silently the whole prompt)."""
    client, base, _ = served
    sampler = client.create_sampling_client(base_model=str(base)).result()
    prompt = types.ModelInput.from_ints(TOKENS)
    full = sampler.compute_logprobs(prompt).result()
    tail = sampler.compute_logprobs(prompt, prompt_logprobs_last_n=2).result()
    assert tail[:-2] == [None] * (len(TOKENS) - 2)
    np.testing.assert_allclose(tail[-2:], full[-2:], atol=1e-6)
    with pytest.raises(tinker.RequestFailedError, match="prompt_logprobs_last_n must be"):
        sampler.compute_logprobs(prompt, prompt_logprobs_last_n=len(TOKENS)).result()


def test_a_sampler_name_saved_again_serves_the_new_weights(served: Any) -> None:
    """The loop save_weights_for_sampler("latest") -> create_sampling_client(path) -> train:
    every new sampler on "latest" scores as the trainer does now (the engine, still holding
    the first "latest", used to serve it for every later one); an older sampler on the path
    serves the replacement too."""
    client, base, _ = served
    tc = client.create_lora_training_client(base_model=str(base), rank=4, seed=5).result()
    first = None
    for _ in range(3):
        path = tc.save_weights_for_sampler("latest").result().path
        sampler = client.create_sampling_client(model_path=path).result()
        first = first or sampler
        scored = sampler.compute_logprobs(types.ModelInput.from_ints(TOKENS)).result()
        np.testing.assert_allclose(scored[1:], _logprobs(tc, TOKENS), atol=1e-4)
        tc.forward_backward([_datum(TOKENS)], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=0.1)).result()
    tc.save_weights_for_sampler("latest").result()
    scored = first.compute_logprobs(types.ModelInput.from_ints(TOKENS)).result()
    np.testing.assert_allclose(scored[1:], _logprobs(tc, TOKENS), atol=1e-4)
