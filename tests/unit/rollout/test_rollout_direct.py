"""``direct_forward``: the split forward of Llama-family models without module calls gives
bitwise the module path's logits (samples, logprobs), is on by default for the classes it
covers, and stands aside for other classes and for models with forward hooks."""

from __future__ import annotations

import pytest
import torch

from relayrl.rollout import GenerationRequest, RolloutEngine, SamplingParams, direct_forward
from rollout_helpers import EOS, PAD, random_prompts, tiny_model


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


@pytest.mark.parametrize("path", ["direct", "modules"])
def test_the_lm_head_projects_only_the_rows_whose_logits_are_used(models: dict, path: str) -> None:
    """A step with two prompts of 9 and 12 tokens and one decode row: the LM head sees 3
    rows (each sequence's last token), not 22 (every prompt token), on both forward paths."""
    from relayrl.rollout.kv_cache import SlotKVCache

    model = models["llama"]
    runner = RolloutEngine(model, eos_token_id=EOS, pad_token_id=PAD, max_slots=3).runner
    seen: list[int] = []
    real_lin = direct_forward._lin

    def lin(x: torch.Tensor, layer: torch.nn.Module) -> torch.Tensor:
        if layer is model.lm_head:
            seen.append(x.reshape(-1, x.shape[-1]).shape[0])
        return real_lin(x, layer)

    handle = None
    if path == "direct":
        direct_forward._lin = lin
    else:  # a hook on the head: the runner stands aside from the direct path
        handle = model.lm_head.register_forward_hook(
            lambda m, i, o: seen.append(i[0].reshape(-1, i[0].shape[-1]).shape[0])
        )
    try:
        cache = SlotKVCache(3, 64)
        prompts = random_prompts([5, 9, 12], seed=22)
        first = runner._forward_split(model, cache, [], [], [], [0], prompts[:1])
        seen.clear()
        nxt = first.argmax(-1).tolist()
        logits = runner._forward_split(model, cache, [0], [5], [nxt], [1, 2], prompts[1:])
    finally:
        direct_forward._lin = real_lin
        if handle is not None:
            handle.remove()
    assert seen == [3]
    assert logits.shape == (3, model.config.vocab_size)
    # the rows are each sequence's last token: the same logits as full forwards
    for ids, row in zip([prompts[0] + nxt, prompts[1], prompts[2]], logits, strict=True):
        with torch.no_grad():
            ref = model(input_ids=torch.tensor([ids])).logits[0, -1]
        torch.testing.assert_close(row, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("prompts", [1, 3])
def test_prefill_attention_is_bitwise_sdpa_attention_forward(prompts: int) -> None:
    """Grouped-query prefill attention through SDPA's enable_gqa (and plain causal for one
    prompt) equals transformers' repeat_kv path bit for bit."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from relayrl.rollout.split_attention import prefill_attention

    g = torch.Generator().manual_seed(3)
    lens = [7, 3, 11][:prompts]
    p = sum(lens)
    q, k, v = (torch.randn(1, h, p, 16, generator=g) for h in (4, 2, 2))
    seg = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)])
    pos = torch.cat([torch.arange(n) for n in lens])
    allowed = (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])
    mask = torch.zeros(1, 1, p, p).masked_fill_(~allowed, torch.finfo(torch.float32).min)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True
    ref, _ = sdpa_attention_forward(module, q, k, v, mask, dropout=0.0, scaling=0.25)
    got = prefill_attention(q, k, v, mask if prompts > 1 else None, 0.25)
    assert torch.equal(got, ref)


class _ShiftedLinear(torch.nn.Linear):
    """A linear that adds a learned shift after its product: the direct path (which reads
    ``weight`` and ``bias`` alone) would drop it, and while the shift is zero the first-use
    check cannot tell."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None)
        self.load_state_dict(linear.state_dict())
        self.shift = torch.nn.Parameter(torch.zeros(linear.out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.shift


def test_replaced_linears_use_the_module_path(models: dict) -> None:
    """A supported class whose projections are not plain ``nn.Linear`` (an adapter, a
    quantised or a subclassed linear) runs through its modules: here a shift that is zero at
    the engine's first use and trained afterwards shows in the samples (the direct path
    would have kept the base model's), and peft's LoRA layers are refused the same way."""
    import copy

    from peft import LoraConfig, get_peft_model

    base = models["llama"]
    model = copy.deepcopy(base)
    for layer in model.model.layers:
        layer.mlp.down_proj = _ShiftedLinear(layer.mlp.down_proj)
    assert direct_forward.supported(base) and not direct_forward.supported(model)
    lora = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"])
    assert not direct_forward.supported(get_peft_model(copy.deepcopy(base), lora).get_base_model())

    reqs = [
        GenerationRequest(p, SamplingParams(temperature=0.8, max_tokens=10, seed=i))
        for i, p in enumerate(random_prompts([6, 2, 9], seed=4))
    ]
    engine = RolloutEngine(model, eos_token_id=EOS, pad_token_id=PAD, max_slots=3)
    first = engine.generate(reqs)  # first use with the shift at zero
    plain = RolloutEngine(base, eos_token_id=EOS, pad_token_id=PAD, max_slots=3).generate(reqs)
    assert [s.response_ids for s in first] == [s.response_ids for s in plain]
    with torch.no_grad():  # "training" moves the shift in place
        for layer in model.model.layers:
            layer.mlp.down_proj.shift.copy_(torch.linspace(-3, 3, model.config.hidden_size))
    shifted = engine.generate(reqs)
    want = RolloutEngine(model, eos_token_id=EOS, pad_token_id=PAD, max_slots=3)
    want.runner.direct = False
    for a, b in zip(shifted, want.generate(reqs), strict=True):
        assert a.response_ids == b.response_ids
        assert a.behaviour_logprobs == b.behaviour_logprobs
    assert [s.response_ids for s in shifted] != [s.response_ids for s in plain]
