"""The RLHF lab end to end on its checked-in seed, and the RLHF paths on its tiny models:
reward-model training and HF format, PPO (fixed and adaptive beta) and GRPO against the reward
model (alone or mixed with a rule), DPO, and the ``rm`` / ``dpo`` / ``demo rlhf`` commands."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from helpers import TEST_SEED, run_config
from relayrl.cli import main
from relayrl.cluster.local import build_local_roles
from relayrl.config import load_config
from relayrl.controller.checkpoint import latest_checkpoint
from relayrl.controller.trainer import train
from relayrl.labs.lab import GOLD_FN, LabConfig, run_lab
from relayrl.model.reward_model import encode
from relayrl.reward.service.rm_scorer import RewardModelScorer
from relayrl.telemetry import read_metrics


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """The default lab (``relayrl demo rlhf``, seed 0): ~1 minute on one CPU thread."""
    root = tmp_path_factory.mktemp("lab")
    cfg = load_config(LabConfig, None, [f"run_dir={root}", "progress=false", f"seed={TEST_SEED}"])
    results = run_lab(cfg, log=lambda *a: None)
    return root, results


@pytest.mark.learning
def test_lab_reproduces_reward_hacking(lab, outcome):
    """beta = 0.1: proxy and true score rise. beta = 0: the proxy rises higher while the true
    score falls (reward hacking). Diversity (distinct bigrams) falls in both.

    Measured over lab seeds 0-4 (``RELAYRL_TEST_SEED``; min / median): beta 0.1 true - sft
    true +0.94 / +1.25, proxy +1.31 / +1.42; beta 0 proxy - beta 0.1 proxy +0.12 / +0.40;
    beta 0 true -3.00 on every seed (sft true -0.44 at worst), grammatical 0.00; beta 0 KL /
    beta 0.1 KL 3.9x / 31x; distinct_2 ratio to sft (max / median) 0.54 / 0.48 (beta 0.1) and
    0.11 / 0.06 (beta 0). Distinct strings are recorded, not asserted: beta 0.1 kept 0.52 / 0.46
    of sft's on seeds 0-4 but 134 of 154 (0.87x) with ATEN_CPU_CAPABILITY=avx2 on seed 0 (the
    figure of the issue's AMD machine), and beta 0's word salad on seed 4 was 256 distinct
    strings of 256 (1.36x sft) while its bigrams fell to 0.11x."""
    _, r = lab
    sft, kl, nokl = r["runs"]["sft"], r["runs"]["ppo_beta0.1"], r["runs"]["ppo_beta0"]
    keys = ("proxy", "true", "grammatical", "kl", "distinct_responses", "distinct_2")
    outcome(
        **{
            f"{name}/{k}": run[k]
            for name, run in (("sft", sft), ("kl", kl), ("nokl", nokl))
            for k in keys
        }
    )
    assert all(r["hacking"].values()), r["hacking"]
    assert kl["proxy"] > sft["proxy"] + 0.8 and kl["true"] > sft["true"] + 0.6
    assert nokl["proxy"] > kl["proxy"] + 0.05
    assert nokl["true"] < sft["true"] - 1.5 and nokl["grammatical"] < 0.2
    assert nokl["kl"] > 2 * kl["kl"]
    assert kl["distinct_2"] < 0.75 * sft["distinct_2"]
    assert nokl["distinct_2"] < 0.3 * sft["distinct_2"]


@pytest.mark.learning
def test_reward_model_near_the_noise_ceiling_and_far_above_chance(lab, outcome):
    _, r = lab
    rm = r["rm"]
    """Measured over lab seeds 0-4 (min / median): held-out label agreement 0.665 / 0.705
    against a noise ceiling of 0.752-0.758 (gap max / median 0.087 / 0.052); agreement with the
    true preference 0.907 / 0.921."""
    outcome(**{k: rm[k] for k in ("label_agreement", "noise_ceiling", "truth_accuracy")})
    assert rm["label_agreement"] > rm["noise_ceiling"] - 0.12, rm
    assert rm["truth_accuracy"] > 0.85, rm
    assert rm["pairs"] == 600 and rm["truth_pairs"] > 300


@pytest.mark.learning
def test_blind_spot_probe_is_measured_and_reported(lab, outcome):
    root, r = lab
    probe = r["blind_spot"]
    """Shuffling a sentence's words costs it ~2.9 in true score; the reward model barely
    notices. Measured over lab seeds 0-4 (min / median): true drop 2.83 / 2.90; the reward
    model's drop (normalised units) is 0.34 / 0.14 of it (max / median); its scores of original
    and shuffle correlate 0.67 / 0.81; shuffles scoring at least their original 0.10 / 0.14."""
    outcome(**{k: v for k, v in probe.items() if isinstance(v, int | float)})
    assert probe["true_shuffled_mean"] < -2.5 < probe["true_original_mean"]
    true_drop = probe["true_original_mean"] - probe["true_shuffled_mean"]
    rm_drop = probe["rm_original_mean"] - probe["rm_shuffled_mean"]
    assert rm_drop < 0.5 * true_drop, probe
    assert probe["rm_corr_original_shuffled"] > 0.5, probe
    assert probe["shuffled_ge_original"] > 0.05, probe
    assert "Blind-spot probe" in (root / "report.md").read_text()


def test_report_has_the_table_and_plots(lab):
    root, r = lab
    text = (root / "report.md").read_text()
    for name in ("sft", "ppo_beta0.1", "ppo_beta0", "dpo"):
        assert f"| {name} |" in text
    pytest.importorskip("matplotlib")
    for png in ("proxy_vs_true.png", "true.png", "kl.png", "distinct.png", "grammatical.png"):
        data = (root / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, png
    saved = json.loads((root / "results.json").read_text())
    assert saved["runs"]["ppo_beta0"]["true"] == r["runs"]["ppo_beta0"]["true"]


def test_reward_model_loads_as_sequence_classification(lab):
    root, _ = lab
    model = AutoModelForSequenceClassification.from_pretrained(
        root / "rm", local_files_only=True
    ).eval()
    assert model.config.num_labels == 1
    scorer = RewardModelScorer(root / "rm", normalize=False)
    prompts, completions = ["rome is", "oslo is"], ["clean and safe .", "dirty"]
    batch = encode(scorer.tokenizer, prompts, completions)
    with torch.no_grad():
        plain = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, 0]
    torch.testing.assert_close(plain, scorer.raw_scores(prompts, completions))
    # right padding does not change a score: scored alone == scored in a batch
    alone = scorer.raw_scores(prompts[1:], completions[1:])
    torch.testing.assert_close(alone, scorer.raw_scores(prompts, completions)[1:])
    assert scorer.stats["eval_accuracy"] > 0.6


def test_ppo_against_the_reward_model_logs_monitors_every_step(lab):
    root, _ = lab
    for run, beta in (("ppo_beta0.1", 0.1), ("ppo_beta0", 0.0)):
        steps = [rec for rec in read_metrics(root / run) if "reward_mean" in rec]
        assert len(steps) == 80
        for rec in steps:
            for key in (
                "monitor/gold",
                "monitor/kl_seq",
                "monitor/distinct_2",
                "monitor/divergence",
                "monitor/gold_grammatical",
                "critic/vf_loss",
            ):
                assert key in rec, (run, key)
            assert rec["kl_beta"] == pytest.approx(beta)
    hacked = [rec for rec in read_metrics(root / "ppo_beta0") if "reward_mean" in rec]
    assert hacked[-1]["monitor/divergence"] > 2.0  # proxy up, gold down


def _rm_run(lab, tmp_path, name, *overrides):
    root, _ = lab
    data = root / "data" / "prompts.jsonl"
    return run_config(
        root / "sft",
        tmp_path / name,
        "data.task=jsonl",
        f"data.train_path={data}",
        f"data.eval_path={data}",
        f"reward.model_path={root / 'rm'}",
        f"monitor.gold_fn={GOLD_FN}",
        "rollout.max_tokens=10",
        *overrides,
    )


def test_grpo_against_the_reward_model_mixed_with_a_rule(lab, tmp_path):
    cfg = _rm_run(
        lab,
        tmp_path,
        "grpo",
        "reward.fn=relayrl.data.city_lang:grammatical_reward",
        "reward.model_weight=0.5",
        "algo.name=grpo",
        "algo.kl_coef=0.05",
        "algo.group_size=8",
        "algo.prompts_per_step=8",
        "optim.lr=1e-3",
        "train.steps=12",
    )
    train(cfg, lambda a, c: build_local_roles(cfg, a, c))
    recs = [r for r in read_metrics(tmp_path / "grpo") if "reward_mean" in r]
    first, last = recs[0], recs[-1]
    for rec in recs:
        assert rec["reward/score"] == pytest.approx(
            rec["reward/grammatical_reward"] + 0.5 * rec["reward/rm"], abs=1e-5
        )
        assert "actor/kl" in rec and "monitor/gold" in rec
    assert last["reward/rm"] > first["reward/rm"]  # the RM score is being optimised


def test_reward_model_inside_the_reward_service(lab, tmp_path):
    """With ``reward.service`` on, the reward model is one of the service's batched model
    scorers (the same loaded copy), mixed with the service's rule functions."""
    cfg = _rm_run(
        lab,
        tmp_path,
        "grpo_service",
        "reward.fn=none",
        "reward.service.functions=[{fn: 'relayrl.data.city_lang:grammatical_reward', "
        "name: grammar}]",
        "algo.name=grpo",
        "algo.group_size=4",
        "algo.prompts_per_step=8",
        "train.steps=3",
    )
    roles = build_local_roles(cfg, cfg.model.path, None)
    assert roles.reward.service is not None
    roles.close()
    train(cfg, lambda a, c: build_local_roles(cfg, a, c))
    recs = [r for r in read_metrics(tmp_path / "grpo_service") if "reward_mean" in r]
    assert len(recs) == 3
    for rec in recs:
        assert rec["reward/score"] == pytest.approx(
            rec["reward/grammar"] + rec["reward/rm"], abs=1e-5
        )


def test_ppo_with_adaptive_beta_against_the_reward_model(lab, tmp_path):
    cfg = _rm_run(
        lab,
        tmp_path,
        "ppo_adaptive",
        "reward.fn=none",
        "algo.name=ppo",
        "algo.kl_coef=0.1",
        "algo.adaptive_kl_target=0.5",
        "algo.adaptive_kl_horizon=100",
        "algo.group_size=1",
        "algo.prompts_per_step=32",
        "train.steps=4",
    )
    out = train(cfg, lambda a, c: build_local_roles(cfg, a, c))
    betas = [r["kl_beta"] for r in read_metrics(tmp_path / "ppo_adaptive") if "kl_beta" in r]
    assert len(betas) == 4 and betas[-1] != pytest.approx(0.1)  # beta adapts
    assert (tmp_path / "ppo_adaptive" / "checkpoints" / "step_000004" / "critic").is_dir()
    assert "critic/vf_loss" in out


@pytest.mark.learning
def test_dpo_with_algo_name_dpo_learns_the_preferences(lab, tmp_path, outcome):
    """Held-out implicit-reward accuracy after 40 DPO steps, measured over lab seeds 0-4
    (min / median): 0.607 / 0.633 (0.5 before: policy == reference; per seed 0.607, 0.623,
    0.720, 0.647, 0.633), 2026-12-07 at 138581f, by ``RELAYRL_TEST_SEED=s
    RELAYRL_OUTCOMES=out.jsonl pytest -m learning tests/integration/test_rlhf_lab.py -k dpo_with``
    for s in 0-4 (docs/development.md); 0.600 / 0.683 on 2026-12-01. The change is the fixture's:
    bisected to 89e8bd0 (LM head on the response positions only), which moves the lab SFT's
    gradients by float32 rounding, so its weights and the pairs sampled from it differ; on one
    lab (seed 2) the DPO figure is the same with either forward path. The held-out pairs are the
    lab's ``pairs_eval.jsonl`` (``data.eval_path``): other pairs of the same 10 ``"<city> is"``
    prompts, not held-out prompts (``split_pairs``'s by-prompt split is not on this path)."""
    root, _ = lab
    cfg = run_config(
        root / "sft",
        tmp_path / "dpo",
        "algo.name=dpo",
        "algo.kl_coef=0.1",
        "algo.prompts_per_step=64",
        "optim.lr=3e-4",
        "data.task=jsonl",
        f"data.train_path={root / 'data' / 'pairs_train.jsonl'}",
        f"data.eval_path={root / 'data' / 'pairs_eval.jsonl'}",
        "data.eval_size=300",
        "train.steps=40",
    )
    out = train(cfg, lambda a, c: pytest.fail("DPO builds no roles"))
    outcome(before=out["eval_before"], after=out["eval_after"])
    assert out["eval_before"] == pytest.approx(0.5)  # policy == reference: every h is 0
    assert out["eval_after"] > 0.55, out
    assert out["dpo/chosen_reward"] > out["dpo/rejected_reward"]
    ckpt = latest_checkpoint(tmp_path / "dpo")
    assert ckpt is not None and ckpt.name == "step_000040"
    AutoModelForCausalLM.from_pretrained(ckpt / "actor", local_files_only=True)


def test_cli_rm_and_dpo_and_their_errors(lab, tmp_path, capsys):
    root, _ = lab
    rm_cfg = tmp_path / "rm.yaml"
    rm_cfg.write_text(
        yaml.safe_dump(
            {
                "model_path": str(root / "rm_base"),
                "output_dir": str(tmp_path / "rm"),
                "train_path": str(root / "data" / "pairs_train.jsonl"),
                "threads": 1,
                "progress": False,
            }
        )
    )
    assert main(["rm", str(rm_cfg), "steps=30", "eval_fraction=0.2"]) == 0
    out = capsys.readouterr().out
    assert "held-out pairwise accuracy" in out and "AutoModelForSequenceClassification" in out
    stats = json.loads((tmp_path / "rm" / "relayrl_rm.json").read_text())
    # held out by prompt (the lab's 10 "<city> is" prompts, ~600 pairs each): whole prompts
    # as near 20% as they go (measured, seed 0: 1197 of 6000)
    assert stats["train_pairs"] + stats["eval_pairs"] == 6000
    assert abs(stats["eval_pairs"] - 1200) <= 300
    assert (tmp_path / "rm" / "metrics.jsonl").is_file()

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "rome is", "chosen": "clean ."}\n')
    assert main(["rm", str(rm_cfg), f"train_path={bad}"]) == 2
    assert "bad.jsonl:1: missing required field 'rejected'" in capsys.readouterr().err

    (tmp_path / "dpo.yaml").write_text("# everything from the overrides\n")
    dpo_args = [
        "dpo",
        str(tmp_path / "dpo.yaml"),
        f"model.path={root / 'sft'}",
        f"run_dir={tmp_path / 'dpo'}",
        "data.task=jsonl",
        f"data.train_path={root / 'data' / 'pairs_train.jsonl'}",
        "threads=1",
        "logging.progress=false",
        "logging.tensorboard=false",
        "train.steps=3",
    ]
    assert main([*dpo_args, "algo.kl_coef=0.1"]) == 0
    assert "held-out preference accuracy" in capsys.readouterr().out
    # `relayrl train` with algo.name=dpo reports the same figure under the same name
    train_args = ["train", *dpo_args[1:], "algo.name=dpo", "algo.kl_coef=0.1", "--overwrite"]
    assert main(train_args) == 0
    out = capsys.readouterr().out
    assert "held-out preference accuracy" in out and "pass rate" not in out
    assert main(dpo_args) == 2  # beta = kl_coef = 0
    assert "algo.kl_coef > 0" in capsys.readouterr().err


def test_cli_demo_rlhf_small(tmp_path, capsys):
    """``relayrl demo rlhf`` plumbing on a very small setting (the full lab is the fixture)."""
    rc = main(
        [
            "demo",
            "--run-dir",
            str(tmp_path),
            "rlhf",
            "progress=false",
            "sft_examples=2000",
            "sft_steps=60",
            "train_pairs=300",
            "eval_pairs=60",
            "rm_epochs=1",
            "probe_sentences=20",
            "betas=[0.1]",
            "ppo_steps=2",
            "ppo_prompts_per_step=16",
            "dpo_steps=2",
            "eval_samples=32",
            "plots=false",
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "report:" in out and "wall time" in out
    text = (tmp_path / "rlhf" / "report.md").read_text()
    assert "| ppo_beta0.1 |" in text and "| dpo |" in text


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_lab_reward_hacking_on_other_seeds(tmp_path, seed):
    """Robustness beyond the checked-in seed (measured: all five seeds 0-4 show both results)."""
    cfg = load_config(LabConfig, None, [f"run_dir={tmp_path}", f"seed={seed}", "progress=false"])
    results = run_lab(cfg, log=lambda *a: None)
    assert all(results["hacking"].values()), results["hacking"]
