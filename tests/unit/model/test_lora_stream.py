"""``merged_stream``: the merged LoRA weights from a stream of full tensors (what an FSDP2
actor gathers one at a time) equal ``merged_state_dict``, and W + (alpha / r) B A by hand."""

from __future__ import annotations

import torch

from relayrl.config import LoraConfig
from relayrl.model import build_tiny_model, load_causal_lm
from relayrl.model.lora import apply_lora, merged_entries, merged_state_dict, merged_stream


def test_merged_stream_is_w_plus_scaled_b_a(tmp_path):
    build_tiny_model(tmp_path / "m", hidden_size=16)
    model = apply_lora(
        load_causal_lm(tmp_path / "m", torch.float64),
        LoraConfig(r=1, alpha=4, dropout=0.0, target_modules=["q_proj"]),
    )
    key = "model.layers.0.self_attn.q_proj.weight"
    layer = model.get_base_model().model.layers[0].self_attn.q_proj
    with torch.no_grad():
        layer.lora_A["default"].weight.fill_(0.5)  # A: 1 x 16, all 0.5
        layer.lora_B["default"].weight.copy_(torch.arange(16.0).view(16, 1))  # B: 16 x 1
    w = layer.base_layer.weight.detach().clone()
    got = dict(merged_stream(model, iter(model.state_dict().items())))
    # scaling alpha / r = 4; (B A)[i, j] = i * 0.5, so the merge adds 2 i to row i
    want = w + 4 * torch.arange(16.0, dtype=torch.float64).view(16, 1) * 0.5
    assert torch.equal(got[key], want)
    ref = merged_state_dict(model)
    assert list(got) == list(ref)  # the base model's keys, in order, no adapter tensors
    for k in ref:
        assert torch.equal(got[k], ref[k]), k
    entries = merged_entries(model)
    assert list(entries) == list(ref)
    assert all(entries[k] == (tuple(ref[k].shape), ref[k].dtype) for k in ref)
