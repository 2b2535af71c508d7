"""``bench/smollm2_throughput.py`` on a tiny random model: the recipe's requests as the trainer
makes them, the own-engine and HF arms on them, one JSON line per setting (the vLLM arm is
left out here: it needs the vLLM venv)."""

from __future__ import annotations

import json

from helpers import load_bench


def test_tiny_run_prints_one_json_line_per_setting(capsys) -> None:
    b = load_bench("smollm2_throughput")
    lines = b.main(
        ["--tiny", "--requests", "8", "--max-tokens", "6,10", "--slots", "4",
         "--vllm-python", "/nonexistent/python"]
    )  # fmt: skip
    printed = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert printed == lines and [x["max_tokens"] for x in lines] == [6, 10]
    for out in lines:
        assert out["bench"] == "smollm2_throughput" and out["requests"] == 8
        assert out["slots"] == 4 and out["vllm"]["skipped"].startswith("no vLLM python")
        for arm in ("engine", "hf"):
            a = out[arm]
            # one sample per request; each at least 1 and at most max_tokens tokens
            assert a["samples"] == 8
            assert 8 <= a["tokens"] <= 8 * out["max_tokens"]
            assert abs(a["mean_len"] - a["tokens"] / 8) < 0.01
            assert a["wall_s"] > 0 and a["tok_s_wall"] > 0 and a["tok_s_cpu"] > 0
            assert 0 <= a["eos_share"] <= 1
        assert out["own_vs_hf_wall"] > 0 and out["own_vs_hf_cpu"] > 0
        assert out["own_vs_vllm_wall"] is None
        assert len(out["load_avg"]["before"]) == 3


def test_requests_are_the_trainers(tmp_path) -> None:
    """G consecutive requests per prompt, the trainer's seeds, the EOS as stop id, the
    setting's max_tokens, the recipe's temperature."""
    b = load_bench("smollm2_throughput")
    model = b.tiny_model(tmp_path / "m")
    reqs, eos, _, info = b.build_requests(b.CONFIG, model, 20, 7, ["data.max_prompt_tokens=768"])
    assert len(reqs) == 20 and info["max_slots"] == 64
    g = 8  # the recipe's algo.group_size
    for i, r in enumerate(reqs):
        assert r.params.max_tokens == 7 and r.params.stop_token_ids == [eos]
        assert r.params.temperature == 1.0 and r.params.top_k == 0 and r.params.top_p == 1.0
        assert r.prompt_ids == reqs[i - i % g].prompt_ids
    assert len({r.params.seed for r in reqs}) == 20
