"""``direct_forward``: the split forward of Llama-family models without module calls gives
bitwise the module path's logits (samples, logprobs), is on by default for the classes it
covers, and stands aside for other classes and for models with forward hooks."""

from __future__ import annotations

import pytest
import torch

from relayrl.rollout import GenerationRequest, RolloutEngine, SamplingParams, direct_forward
from test_rollout_helpers import EOS, PAD, random_prompts, tiny_model


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.nn.Module]:
    root = tmp_path_factory.mktemp("direct-models")
    return {arch: tiny_model(root, arch) for arch in ("llama", "qwen2", "gpt2")}


def _run(model: torch.nn.Module, direct: bool) -> tuple[list, RolloutEngine]:
    engine = RolloutEngine(model, eos_token_id=EOS, pad_token_id=PAD, max_slots=3)
    engine.runner.direct = direct
    # long next to short rows: several decode length buckets and admissions mid-decode
    engine.runner.bucket_min_len, engine.runner.bucket_overhead = 2, 1
    prompts = random_prompts([6, 2, 19, 1, 5, 7, 3], seed=21)
    reqs = [
        GenerationRequest(p, SamplingParams(temperature=0.8, max_tokens=14, seed=i))
        for i, p in enumerate(prompts)
    ]
    return engine.generate(reqs), engine


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_direct_path_is_bitwise_the_module_path(models: dict, arch: str) -> None:
    model = models[arch]
    assert direct_forward.supported(model)
    fast, engine = _run(model, direct=True)
    slow, reference = _run(model, direct=False)
    assert engine.runner._direct_ok[type(model)] is True  # passed its first-use check
    assert type(model) not in reference.runner._direct_ok  # never consulted when off
    for a, b in zip(fast, slow, strict=True):
        assert a.response_ids == b.response_ids
        assert a.behaviour_logprobs == b.behaviour_logprobs  # exactly, not approximately


def test_other_classes_and_hooked_models_use_the_module_path(models: dict) -> None:
    assert not direct_forward.supported(models["gpt2"])
    _, engine = _run(models["gpt2"], direct=True)
    assert engine.runner._direct_ok[type(models["gpt2"])] is False
    model = models["llama"]
    calls: list[int] = []
    handle = model.model.layers[0].mlp.register_forward_hook(lambda m, i, o: calls.append(1))
    try:
        assert direct_forward.has_hooks(model)
        hooked, _ = _run(model, direct=True)
    finally:
        handle.remove()
    assert calls  # the hook ran: the forward went through the modules
    plain, _ = _run(model, direct=False)
    assert [s.response_ids for s in hooked] == [s.response_ids for s in plain]
