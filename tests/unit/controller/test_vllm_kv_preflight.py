"""The vLLM KV-cache preflight (``relayrl.controller.preflight.kv_cache_bytes`` /
``check_vllm_kv_cache``): the bytes of one sequence, computed by hand from the model's
config.json, and the one-line refusal when ``rollout.vllm_kv_cache_gib`` cannot hold it
(vLLM itself would refuse after loading the model, with a long error)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relayrl.config import ConfigError, RunConfig
from relayrl.controller.preflight import check_vllm_kv_cache, kv_cache_bytes

# SmolLM2-135M-Instruct's config.json (the keys the formula reads): 30 layers, 9 query heads
# of 576 / 9 = 64 dims, 3 KV heads (GQA), 8192 positions
SMOLLM2 = {
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "hidden_size": 576,
    "max_position_embeddings": 8192,
}


def test_kv_bytes_by_hand() -> None:
    # 2 (K, V) x 30 layers x 3 KV heads x 64 dims x 4 bytes (fp32) = 46080 bytes per token
    assert kv_cache_bytes(SMOLLM2, "float32", 1) == 46_080
    assert kv_cache_bytes(SMOLLM2, "float32", 8192) == 377_487_360  # 0.3516 GiB > 0.25
    assert kv_cache_bytes(SMOLLM2, "bfloat16", 8192) == 188_743_680
    # GPT-2 keys, no GQA: 2 x 1 layer x 2 heads x (32 / 2) dims x 4 bytes x 128 tokens
    gpt2 = {"n_layer": 1, "n_head": 2, "n_embd": 32, "n_positions": 128}
    assert kv_cache_bytes(gpt2, "float32", 128) == 32_768
    # an explicit head_dim wins over hidden_size / heads; a multimodal model's text_config
    assert kv_cache_bytes({**SMOLLM2, "head_dim": 128}, "float32", 1) == 92_160
    assert kv_cache_bytes({"text_config": SMOLLM2}, "float32", 1) == 46_080
    assert kv_cache_bytes({"hidden_size": 576}, "float32", 1) is None  # nothing to check


def _cfg(tmp_path: Path, **rollout: object) -> RunConfig:
    model = tmp_path / "smollm2"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(SMOLLM2))
    return RunConfig.model_validate(
        {"model": {"path": str(model)}, "rollout": {"backend": "vllm", **rollout}}
    )


def test_refusal_names_the_keys_and_the_gib(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)  # the default rollout.vllm_kv_cache_gib: 0.25
    with pytest.raises(ConfigError) as err:
        check_vllm_kv_cache(cfg, 8192)
    # 0.25 GiB / 46080 bytes = 5825.4 tokens: 364 whole 16-token blocks = 5824
    assert str(err.value) == (
        f"rollout.vllm_kv_cache_gib=0.25 cannot hold one 8192-token sequence of model.path "
        f"{cfg.model.path} (float32 KV needs 0.352 GiB): set rollout.vllm_kv_cache_gib >= "
        "0.352 or rollout.max_model_len <= 5824"
    )
    check_vllm_kv_cache(cfg, 5824)  # what the message offers fits
    with pytest.raises(ConfigError):
        check_vllm_kv_cache(cfg, 5825)  # a 16-token block more does not
    check_vllm_kv_cache(_cfg(tmp_path, vllm_kv_cache_gib=0.352), 8192)
