"""RLHF building blocks without training: the city-language grammar and true score, preference
data handling (bad rows), the Bradley-Terry and DPO losses, monitors, reward mixing and the
batched-scorer hook of the reward worker."""

from __future__ import annotations

import json
import math
import random
from types import SimpleNamespace

import pytest
import torch

from relayrl.algos.preference_loss import bradley_terry_loss, dpo_loss
from relayrl.config import ConfigError, RunConfig, load_config
from relayrl.controller.trainer import run_monitor
from relayrl.data import DataError
from relayrl.data import city_lang as cl
from relayrl.data.preferences import load_preferences, split_pairs
from relayrl.reward import get_reward_fn
from relayrl.reward.service.rm_scorer import MixedReward
from relayrl.rollout.types import Sample
from relayrl.telemetry.monitors import (
    distinct_n,
    distinct_responses,
    pairwise_agreement,
    pearson,
    sequence_kl,
)
from relayrl.workers import RewardWorker

# ------------------------------------------------------------------------- city language


@pytest.mark.parametrize(
    ("completion", "score", "grammatical"),
    [
        ("clean .", 1.0, True),
        ("dirty .", -1.0, True),
        ("old .", 0.0, True),
        ("clean and safe .", 2.0, True),
        ("clean , dirty and loud .", -1.0, True),
        ("safe , green and calm .", 3.0, True),
        ("  safe   and   calm . ", 2.0, True),  # extra whitespace is not a word
        ("clean", -3.0, False),  # unfinished
        ("clean and", -3.0, False),
        ("", -3.0, False),
        ("clean and clean .", -3.0, False),  # repeated attribute
        ("clean , safe , green and calm .", -3.0, False),  # 4 attributes
        ("clean safe .", -3.0, False),  # missing "and"
        ("clean , safe .", -3.0, False),
        ("clean and safe and calm .", -3.0, False),
        ("and clean .", -3.0, False),
        ("clean . safe .", -3.0, False),  # words after the full stop
        ("rome .", -3.0, False),  # a city is not an attribute
        ("clean safe clean safe clean safe", -3.0, False),
    ],
)
def test_true_score(completion, score, grammatical):
    v = cl.judge("rome is", completion)
    assert v.score == score and v.grammatical is grammatical
    assert cl.true_score("rome is", completion) == score


def test_true_score_needs_a_city_prompt():
    assert cl.true_score("paris is", "clean .") == -3.0  # not a city of the language
    assert cl.true_score("rome", "clean .") == -3.0
    out = cl.true_score_reward("oslo is", "calm and safe .", {})
    assert out == {"score": 2.0, "grammatical": 1.0, "finished": 1.0}
    assert cl.grammatical_reward("oslo is", "calm calm .", {}) == 0.0


def test_language_samples_are_grammatical_with_mean_zero():
    pairs = cl.CityLanguage(seed=3).sample_many(3000)
    scores = [cl.true_score(p, c) for p, c in pairs]
    assert all(cl.judge(p, c).grammatical for p, c in pairs)
    assert abs(sum(scores) / len(scores)) < 0.1  # symmetric good / bad
    assert {len(c.split()) for _, c in pairs} == {2, 4, 6}  # 1, 2, 3 attributes


def test_reward_specs_of_the_old_rlhf_package_still_resolve():
    """Configs of runs made before the move name ``relayrl.rlhf.city_lang``: same functions."""
    assert get_reward_fn("relayrl.rlhf.city_lang:true_score_reward") is cl.true_score_reward
    assert get_reward_fn("relayrl.rlhf.city_lang:grammatical_reward") is cl.grammatical_reward
    assert get_reward_fn("relayrl.data.city_lang:grammatical_reward") is cl.grammatical_reward


def test_bradley_terry_probability_and_noise_ceiling():
    assert cl.bt_label_probability(1.0, 1.0) == 0.5
    assert cl.bt_label_probability(2.0, 0.0) == pytest.approx(1 / (1 + math.exp(-2)))
    assert cl.bt_label_probability(0.0, 2.0, temperature=2.0) == pytest.approx(
        1 / (1 + math.exp(1))
    )
    assert cl.bt_label_probability(-500.0, 500.0) == pytest.approx(0.0)  # no overflow
    # ceiling: ties 0.5; a gap of 1 gives sigmoid(1)
    assert cl.noise_ceiling([(0.0, 0.0), (1.0, 0.0)]) == pytest.approx(
        (0.5 + 1 / (1 + math.exp(-1))) / 2
    )


def test_shuffle_keeps_the_bag_of_words_and_breaks_the_grammar():
    rng = random.Random(0)
    for _prompt, completion in cl.CityLanguage(seed=1, length_weights=(0, 0.5, 0.5)).sample_many(
        200
    ):
        shuffled = cl.shuffle_words(completion, rng)
        assert shuffled != completion
        assert sorted(shuffled.split()) == sorted(completion.split())
    assert cl.shuffle_words("clean", rng) == "clean"


# ------------------------------------------------------------------------ preference data


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_preferences_skip_identical_and_empty_rows_with_counts(tmp_path):
    path = _write(
        tmp_path / "p.jsonl",
        [
            {"prompt": "q", "chosen": "good", "rejected": "bad", "source": "x"},
            {"prompt": "q", "chosen": "same", "rejected": " same "},
            {"prompt": "q", "chosen": "", "rejected": "bad"},
            {"prompt": "q", "chosen": "good", "rejected": "   "},
            "",
            {"prompt": "", "chosen": "a", "rejected": "b"},  # an empty prompt is allowed
        ],
    )
    data = load_preferences(path)
    assert [(p.chosen, p.rejected) for p in data.pairs] == [("good", "bad"), ("a", "b")]
    assert data.pairs[0].extra == {"source": "x"}
    assert dict(data.skipped) == {"identical": 1, "empty_completion": 2}
    assert "skipped 3 preference rows" in data.skip_summary()


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"prompt": "q", "chosen": "a"}, "p.jsonl:2: missing required field 'rejected'"),
        ({"chosen": "a", "rejected": "b"}, "p.jsonl:2: missing required field 'prompt'"),
        ({"prompt": "q", "chosen": 3, "rejected": "b"}, "field 'chosen' must be a string"),
        ({"prompt": "q", "chosen": None, "rejected": "b"}, "got null"),
        ('{"prompt": "q", "chosen": "a"', "p.jsonl:2: invalid JSON"),
        ('["q", "a", "b"]', "expected an object"),
    ],
)
def test_preferences_bad_rows_are_errors_naming_the_line(tmp_path, row, message):
    path = _write(tmp_path / "p.jsonl", [{"prompt": "q", "chosen": "a", "rejected": "b"}, row])
    with pytest.raises(DataError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_preferences(path)


def test_preferences_with_no_usable_pair_is_an_error(tmp_path):
    path = _write(tmp_path / "p.jsonl", [{"prompt": "q", "chosen": "a", "rejected": "a"}])
    with pytest.raises(DataError, match="no usable preference pairs.*identical: 1"):
        load_preferences(path)
    with pytest.raises(DataError, match="file not found"):
        load_preferences(tmp_path / "missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match="the file is empty"):
        load_preferences(tmp_path / "empty.jsonl")


def test_preferences_from_a_local_hf_dataset(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict(
        {"prompt": ["q", "q"], "chosen": ["good", "x"], "rejected": ["bad", "x"]}
    )
    ds.save_to_disk(str(tmp_path / "ds"))
    data = load_preferences(tmp_path / "ds")
    assert len(data.pairs) == 1 and data.skipped["identical"] == 1


def test_split_pairs_is_seeded_and_disjoint(tmp_path):
    path = _write(
        tmp_path / "p.jsonl",
        [{"prompt": str(i), "chosen": "a", "rejected": "b"} for i in range(20)],
    )
    pairs = load_preferences(path).pairs
    train, held = split_pairs(pairs, 0.25, seed=1)
    assert len(held) == 5 and len(train) == 15
    assert {p.prompt for p in train}.isdisjoint({p.prompt for p in held})
    assert [p.prompt for p in split_pairs(pairs, 0.25, seed=1)[1]] == [p.prompt for p in held]


def test_split_pairs_holds_out_whole_prompts(tmp_path):
    """Four pairs per prompt (UltraFeedback-style): no held-out prompt is trained on; the
    held-out share is whole prompts, as near 25% of the pairs as whole prompts go."""
    rows = [
        {"prompt": f"q{i}", "chosen": f"good {j}", "rejected": f"bad {j}"}
        for i in range(10)
        for j in range(4)
    ]
    pairs = load_preferences(_write(tmp_path / "p.jsonl", rows)).pairs
    for seed in range(5):
        train, held = split_pairs(pairs, 0.25, seed=seed)
        assert {p.prompt for p in train}.isdisjoint({p.prompt for p in held})
        assert len(held) == 8 and len(train) == 32  # 2 prompts: 8 pairs, as near 10 as 12
        assert sorted(train + held, key=id) == sorted(pairs, key=id)
    one = [p for p in pairs if p.prompt == "q0"]
    train, held = split_pairs(one, 0.25, seed=0)  # one prompt: split by pair (1 + 3)
    assert len(held) == 1 and len(train) == 3


# ---------------------------------------------------------------------------------- losses


def test_bradley_terry_loss_by_hand():
    rc = torch.tensor([2.0, 0.0, 1.0])
    rr = torch.tensor([0.0, 1.0, 1.0])
    loss, stats = bradley_terry_loss(rc, rr)
    expected = (math.log1p(math.exp(-2)) + math.log1p(math.exp(1)) + math.log(2)) / 3
    assert float(loss) == pytest.approx(expected)
    assert stats["accuracy"] == pytest.approx((1 + 0 + 0.5) / 3)
    assert stats["margin"] == pytest.approx(1 / 3)


def test_dpo_loss_by_hand():
    # policy == reference: h = 0, loss = log 2, implicit rewards 0
    z = torch.zeros(4)
    loss, stats = dpo_loss(z, z, z, z, beta=0.1)
    assert float(loss) == pytest.approx(math.log(2)) and stats["accuracy"] == 0.5
    # h = beta * ((-1 - -2) - (-3 - -2)) = 0.5 * 2 = 1
    one = torch.ones(1)
    loss, stats = dpo_loss(-1 * one, -3 * one, -2 * one, -2 * one, beta=0.5)
    assert float(loss) == pytest.approx(math.log1p(math.exp(-1.0)))
    assert stats["chosen_reward"] == pytest.approx(0.5)
    assert stats["rejected_reward"] == pytest.approx(-0.5)
    assert stats["margin"] == pytest.approx(1.0) and stats["accuracy"] == 1.0


# -------------------------------------------------------------------------------- monitors


def test_distinct_n_and_responses():
    texts = ["a b a", "a b", "a b"]
    # unigrams: a b a a b a b -> {a, b}: 2/7; bigrams: ab ba ab ab -> {ab, ba}: 2/4
    assert distinct_n(texts, 1) == pytest.approx(2 / 7)
    assert distinct_n(texts, 2) == pytest.approx(2 / 4)
    assert distinct_n(["a"], 2) == 0.0
    assert distinct_responses(texts) == 2
    assert distinct_responses(["x ", "x"]) == 1


def test_sequence_kl_pearson_and_agreement():
    logp = torch.tensor([[-1.0, -2.0, -9.0], [-1.0, 0.0, 0.0]])
    ref = torch.tensor([[-2.0, -2.0, 0.0], [-0.5, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert sequence_kl(logp, ref, mask).tolist() == [1.0, -0.5]
    assert pearson([1, 2, 3], [2, 4, 6]) == pytest.approx(1.0)
    assert math.isnan(pearson([1, 1, 1], [1, 2, 3]))
    # gold 0 < 1 < 2; proxy orders (0,1) right, (0,2) right, (1,2) as a tie -> (1 + 1 + .5)/3
    assert pairwise_agreement([0.0, 5.0, 5.0], [0.0, 1.0, 2.0]) == pytest.approx(2.5 / 3)
    assert math.isnan(pairwise_agreement([1.0, 2.0], [1.0, 1.0]))


class _Tok:
    """Decodes ids as words of a fixed vocabulary (stand-in for a tokenizer)."""

    vocab = ["<eos>", "clean", "safe", ".", "and", "dirty"]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(self.vocab[i] for i in ids if not (skip_special_tokens and i == 0))


def _sample(ids, prompt="rome is"):
    return Sample(
        0, [9], list(ids), [0.0] * len(ids), [0] * len(ids), "eos", metadata={"prompt": prompt}
    )


def _experience(samples, scores, logp=None, ref=None):
    r = max(len(s.response_ids) for s in samples)
    mask = torch.zeros(len(samples), r)
    for i, s in enumerate(samples):
        mask[i, : len(s.response_ids)] = 1
    return SimpleNamespace(  # the fields of an Experience the monitor reads
        samples=samples,
        scores=torch.tensor(scores),
        old_logprobs=logp,
        ref_logprobs=ref,
        behaviour_logprobs=None,
        response_mask=mask,
    )


def test_run_monitor_proxy_vs_gold_and_divergence():
    cfg = load_config(RunConfig, None, ["monitor.gold_fn=relayrl.data.city_lang:true_score_reward"])
    mon = run_monitor(cfg, _Tok())
    samples = [_sample([1, 3, 0]), _sample([5, 3, 0]), _sample([1, 4, 2, 3, 0])]
    logp = torch.full((3, 5), -1.0)
    out = mon(_experience(samples, [1.0, -1.0, 2.0], logp, logp + 0.5))
    assert out["monitor/gold"] == pytest.approx((1 - 1 + 2) / 3)
    assert out["monitor/gold_grammatical"] == 1.0
    assert out["monitor/proxy_gold_corr"] == pytest.approx(1.0)
    assert out["monitor/proxy_gold_agreement"] == 1.0
    assert out["monitor/divergence"] == 0.0  # the first step is the baseline
    assert out["monitor/distinct_responses"] == 3.0
    assert out["monitor/kl_seq"] == pytest.approx(-0.5 * (3 + 3 + 5) / 3)
    # next step: the proxy climbs while the gold falls (clean clean . is ungrammatical)
    hacked = [_sample([1, 1, 3, 0])] * 3
    out2 = mon(_experience(hacked, [3.0, 3.0, 3.0]))
    assert out2["monitor/gold"] == -3.0 and out2["monitor/gold_grammatical"] == 0.0
    assert out2["monitor/divergence"] > 3.0
    assert out2["monitor/distinct_responses"] == 1.0
    assert "monitor/kl_seq" not in out2  # no reference logprobs in that batch


def test_run_monitor_without_gold_logs_diversity_only():
    mon = run_monitor(load_config(RunConfig, None, []), _Tok())
    out = mon(_experience([_sample([1, 3, 0]), _sample([1, 3, 0])], [0.0, 0.0]))
    assert out["monitor/distinct_frac"] == 0.5 and not any("gold" in k for k in out)


# ------------------------------------------------------------------------- reward plumbing


class _CountingScorer:
    """A batch scorer that records its calls: score = number of 'clean' words."""

    def __init__(self):
        self.calls = []

    def score_batch(self, prompts, completions, samples):
        self.calls.append(len(completions))
        return [float(c.split().count("clean")) for c in completions]


def test_reward_worker_calls_a_batch_scorer_once_per_batch():
    scorer = _CountingScorer()
    worker = RewardWorker(scorer, _Tok())
    scores, stats = worker.score([_sample([1, 1, 3, 0]), _sample([5, 3, 0]), _sample([1, 3])])
    assert scores.tolist() == [2.0, 0.0, 1.0] and scorer.calls == [3]
    assert stats["reward/score"] == pytest.approx(1.0)


def test_mixed_reward_weights_and_logs_components():
    scorer = _CountingScorer()
    mixed = MixedReward([("grammatical", cl.grammatical_reward, 1.0), ("rm", scorer, 0.5)])
    worker = RewardWorker(mixed, _Tok())
    scores, stats = worker.score([_sample([1, 3, 0]), _sample([1, 1, 3, 0])])
    # "clean ." grammatical 1 + 0.5 * 1; "clean clean ." 0 + 0.5 * 2
    assert scores.tolist() == [1.5, 1.0] and scorer.calls == [2]
    assert stats["reward/grammatical"] == 0.5 and stats["reward/rm"] == 1.5
    with pytest.raises(ValueError, match="duplicate"):
        MixedReward([("a", scorer, 1.0), ("a", scorer, 1.0)])


def test_config_accepts_reward_model_monitor_and_dpo():
    cfg = load_config(
        RunConfig,
        None,
        [
            "algo.name=dpo",
            "algo.kl_coef=0.1",
            "reward.fn=none",
            "reward.model_path=/x/rm",
            "reward.model_weight=0.5",
            "monitor.gold_fn=relayrl.data.city_lang:true_score_reward",
        ],
    )
    assert cfg.reward.model_path == "/x/rm" and cfg.algo.name == "dpo"
    with pytest.raises(ConfigError, match="monitor.nope"):
        load_config(RunConfig, None, ["monitor.nope=1"])
    with pytest.raises(ConfigError, match="reward.model_batch_size"):
        load_config(RunConfig, None, ["reward.model_batch_size=0"])
