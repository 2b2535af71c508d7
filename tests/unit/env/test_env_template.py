"""Chat-template rendering: the prefix property checked at every turn, and a template that
breaks it starts a new, counted training sample instead of training on re-rendered tokens."""

from __future__ import annotations

import pytest
import torch

from relayrl.algos import compute_advantages
from relayrl.controller.algorithms import last_token_rewards
from relayrl.env import ChatTemplateRenderer, FunctionEnvironment, StepResult, TrajectoryBuilder
from relayrl.env.runner import EpisodeRunner, RunnerLimits
from relayrl.env.scoring import expand_episodes, expand_segments
from relayrl.model import load_causal_lm, load_tokenizer
from relayrl.model.tiny import build_char_tokenizer, build_tiny_model
from relayrl.rollout import GenerationRequest, RolloutEngine, SamplingParams
from relayrl.workers import Experience

# assistant turns end with EOS then a newline, like most real templates' end-of-turn token
KEEPS = (
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}<eos>{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)
# drops every earlier assistant turn's content (as templates that strip old reasoning do)
DROPS = (
    "{% for m in messages %}{{ m['role'][0] }}:"
    "{% if m['role'] != 'assistant' or loop.last %}{{ m['content'] }}{% endif %}{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)


def _tok(template: str):
    tok = build_char_tokenizer()
    tok.chat_template = template
    return tok


def test_template_that_keeps_the_prefix_appends_only_the_observation():
    tok = _tok(KEEPS)
    r = ChatTemplateRenderer(tok)
    msgs = [{"role": "user", "content": "2*3"}]
    prompt = r.conversation(msgs)
    assert tok.decode(prompt) == "u:2*3\na:"
    b = TrajectoryBuilder(prompt)
    turn = tok("6", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    b.add_turn(prompt, turn, [-1.0, -1.0], [0, 0])
    msgs += [
        {"role": "assistant", "content": r.assistant_text(turn)},
        {"role": "tool", "content": "ok"},
    ]
    assert b.extend_to(r.conversation(msgs)) is True
    seg = b.current
    assert tok.decode(seg.response_ids) == "6<eos>\nt:ok\na:"
    assert seg.loss_mask == [1, 1] + [0] * len("\nt:ok\na:")
    assert b.prefix_breaks == 0


@pytest.fixture(scope="module")
def engine_and_path(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("tpl") / "m", hidden_size=32, seed=2)
    model = load_causal_lm(path).eval()
    tok = load_tokenizer(path)
    return model, tok


def test_a_template_that_breaks_the_prefix_starts_a_new_counted_segment(engine_and_path):
    model, _ = engine_and_path
    tok = _tok(DROPS)
    engine = RolloutEngine(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)

    def step(message, state):
        state["n"] = state.get("n", 0) + 1
        return StepResult([{"role": "user", "content": "again"}], done=state["n"] >= 2)

    env = lambda: FunctionEnvironment(lambda row, st: [{"role": "user", "content": "hi"}], step)  # noqa: E731
    runner = EpisodeRunner(
        engine,
        env,
        ChatTemplateRenderer(tok, incremental=False),  # re-rendered: DROPS breaks the prefix
        RunnerLimits(max_turns=3, max_turn_tokens=5, max_model_len=256),
    )
    reqs = [
        GenerationRequest(
            [1], SamplingParams(max_tokens=5, seed=i), group_id=0, metadata={"prompt": "hi"}
        )
        for i in range(2)
    ]
    try:
        samples = runner.generate(reqs)
        m = runner.env_metrics()
    finally:
        runner.close()
    assert m["env/prefix_breaks"] == 2  # one per episode: turn 2's context is a re-rendering
    for s in samples:
        info = s.metadata["env"]
        assert info["prefix_breaks"] == 1 and info["turns"] == 2
        (first,) = info["segments"]
        # each segment trains only its own turn; the new segment's prompt is the re-rendering
        assert all(x == 1 for x in first.loss_mask) and all(x == 1 for x in s.loss_mask)
        assert tok.decode(s.prompt_ids).endswith("u:again\na:")
    flat, scores = expand_segments(samples, torch.tensor([1.0, 0.0]))
    assert len(flat) == 4 and scores.tolist() == [1.0, 1.0, 0.0, 0.0]
    assert [s.group_id for s in flat] == [0, 0, 0, 0]
    _, _, episodes = expand_episodes(samples, torch.tensor([1.0, 0.0]))
    assert episodes == [0, 0, 1, 1]  # each episode counts once in GRPO's group statistics
    exp = Experience.from_samples(flat, tok.pad_token_id)
    adv, _ = compute_advantages(
        "grpo",
        token_rewards=last_token_rewards(scores, exp.response_mask),
        response_mask=exp.response_mask,
        group_index=exp.group_index,
        episode_index=episodes,
        eps=0.0,
    )
    # one group of two episodes scored 1 and 0: +-(1/2) / sqrt(1/2) = +-0.7071 on every
    # trained token of both segments (per row it would be +-0.5 / sqrt(1/3) = +-0.866)
    per_row = (adv.sum(-1) / exp.response_mask.sum(-1)).tolist()
    assert per_row == pytest.approx([0.5**0.5, 0.5**0.5, -(0.5**0.5), -(0.5**0.5)])
    exp = Experience.from_samples(flat, tok.pad_token_id)
    assert int(exp.response_mask.sum()) == sum(len(s.response_ids) for s in flat)


def test_the_bridge_keeps_the_prefix_under_a_template_that_drops_earlier_turns(engine_and_path):
    """Bridged (the default), the same template never breaks the prefix: the model's turns
    stay as generated, only the template's text after each turn is appended."""
    model, _ = engine_and_path
    tok = _tok(DROPS)
    engine = RolloutEngine(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)

    def step(message, state):
        state["n"] = state.get("n", 0) + 1
        return StepResult([{"role": "user", "content": "again"}], done=state["n"] >= 2)

    env = lambda: FunctionEnvironment(lambda row, st: [{"role": "user", "content": "hi"}], step)  # noqa: E731
    runner = EpisodeRunner(
        engine,
        env,
        ChatTemplateRenderer(tok),
        RunnerLimits(max_turns=3, max_turn_tokens=5, max_model_len=256),
    )
    reqs = [
        GenerationRequest(
            [1], SamplingParams(max_tokens=5, seed=i), group_id=0, metadata={"prompt": "hi"}
        )
        for i in range(2)
    ]
    try:
        samples = runner.generate(reqs)
        m = runner.env_metrics()
    finally:
        runner.close()
    assert m.get("env/prefix_breaks", 0) == 0
    for s in samples:
        assert s.metadata["env"]["turns"] == 2 and not s.metadata["env"]["segments"]
        assert tok.decode(s.response_ids).count("u:again\na:") == 1
