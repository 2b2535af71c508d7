"""Token-exact trajectories on hand-built conversations: prefix property, loss masks, and the
packed batch's masks, lengths and rewards with observation tokens inside a row."""

from __future__ import annotations

import pytest
import torch

from relayrl.algos import compute_advantages
from relayrl.controller.algorithms import last_token_rewards
from relayrl.env import (
    EnvError,
    PlainRenderer,
    PrefixViolation,
    StepResult,
    TrajectoryBuilder,
    as_step_result,
    check_messages,
)
from relayrl.model.tiny import build_char_tokenizer
from relayrl.rollout import Sample
from relayrl.workers import Experience


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_plain_rendering_is_documented_format(tok):
    r = PlainRenderer(tok)
    prompt = r.prompt([{"role": "system", "content": "s"}, {"role": "user", "content": "2*3?"}])
    assert tok.decode(prompt) == "S:s\nU:2*3?\nA:"
    obs = r.observation([{"role": "tool", "content": "6"}])
    assert tok.decode(obs) == "T:6\nA:"


def test_prefix_property_and_loss_mask_on_a_hand_built_conversation(tok):
    r = PlainRenderer(tok)
    eos = tok.eos_token_id
    prompt = r.prompt([{"role": "user", "content": "12*34?"}])
    b = TrajectoryBuilder(prompt)
    turn1 = ids(tok, "<tool_call>x</tool_call>") + [eos]
    b.add_turn(prompt, turn1, [-0.5] * len(turn1), [3] * len(turn1))
    ctx1 = b.context
    obs = r.observation([{"role": "tool", "content": "408"}])
    b.add_observation(obs)
    assert b.context[: len(ctx1)] == ctx1  # prefix property
    turn2 = ids(tok, "408") + [eos]
    b.add_turn(b.context, turn2, [-0.25] * len(turn2), [4] * len(turn2))
    (seg,) = b.trained_segments()
    assert seg.prompt_ids == prompt
    assert seg.response_ids == turn1 + obs + turn2
    assert seg.loss_mask == [1] * len(turn1) + [0] * len(obs) + [1] * len(turn2)
    assert seg.logprobs == [-0.5] * len(turn1) + [0.0] * len(obs) + [-0.25] * len(turn2)
    # observation tokens carry the version of the model token before them
    assert seg.versions == [3] * len(turn1) + [3] * len(obs) + [4] * len(turn2)
    assert tok.decode(seg.context) == "U:12*34?\nA:<tool_call>x</tool_call><eos>T:408\nA:408<eos>"
    assert b.turns == 2 and b.prefix_breaks == 0
    assert b.total_tokens == len(prompt) + len(turn1) + len(obs) + len(turn2)


def test_a_turn_from_another_context_is_a_prefix_violation(tok):
    b = TrajectoryBuilder([5, 6, 7])
    with pytest.raises(PrefixViolation, match="not the trajectory's 3-token context"):
        b.add_turn([5, 6], [8], [0.0], [0])
    with pytest.raises(ValueError, match="1 tokens but 2 logprobs"):
        b.add_turn([5, 6, 7], [8], [0.0, 0.0], [0])


def test_a_rerendering_that_breaks_the_prefix_starts_a_new_counted_segment():
    b = TrajectoryBuilder([1, 2])
    b.add_turn([1, 2], [3, 4], [-1.0, -1.0], [0, 0])
    assert b.extend_to([1, 2, 3, 4, 9]) is True  # prefix kept: 9 appended, mask 0
    assert b.current.loss_mask == [1, 1, 0]
    b.add_turn([1, 2, 3, 4, 9], [5], [-2.0], [1])
    # a template that drops turn 1's tokens when re-rendering: new segment, counted
    assert b.extend_to([1, 2, 7, 9, 5, 9]) is False
    assert b.prefix_breaks == 1 and len(b.segments) == 2
    assert b.current.prompt_ids == [1, 2, 7, 9, 5, 9] and b.current.response_ids == []
    b.add_turn([1, 2, 7, 9, 5, 9], [6], [-3.0], [1])
    assert [s.response_ids for s in b.trained_segments()] == [[3, 4, 9, 5], [6]]
    assert b.total_tokens == 2 + 4 + 1


def test_malformed_messages_are_env_errors_naming_the_entry():
    with pytest.raises(EnvError, match="message 1 has role 'robot'"):
        check_messages([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}], "x")
    with pytest.raises(EnvError, match="content of type int"):
        check_messages([{"role": "user", "content": 3}], "reset")
    with pytest.raises(EnvError, match="returned int"):
        as_step_result(3, "step")
    assert as_step_result("more", "step").observation == [{"role": "user", "content": "more"}]
    assert as_step_result(StepResult(done=True, reward=1.0), "step").reward == 1.0


def _multi_turn_batch() -> Experience:
    # row 0: prompt [1,2], response m m o o m (m = model token, o = observation token)
    # row 1: single-turn prompt [3], response m m (loss_mask None = all ones)
    s0 = Sample(
        0,
        [1, 2],
        [10, 11, 12, 13, 14],
        [-1.0, -2.0, 0.0, 0.0, -3.0],
        [0, 0, 0, 0, 1],
        "eos",
        group_id=0,
        loss_mask=[1, 1, 0, 0, 1],
    )
    s1 = Sample(1, [3], [20, 21], [-0.5, -0.5], [1, 1], "eos", group_id=0)
    return Experience.from_samples([s0, s1], pad_id=0)


def test_experience_masks_observation_tokens_but_attends_to_them():
    exp = _multi_turn_batch()
    assert exp.response_mask.tolist() == [[1, 1, 0, 0, 1], [1, 1, 0, 0, 0]]
    p = exp.batch.prompt_width
    assert exp.batch.attention_mask[:, p:].tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert exp.response_lengths.tolist() == [5, 2]  # real tokens, not mask sums
    meta = exp.meta()
    assert meta["response_length_mean"] == 3.5 and meta["response_length_max"] == 5
    assert meta["trained_length_mean"] == 2.5
    # trimming keeps every real token of the longest row (mask sum 3 would cut two)
    assert exp.trimmed().batch.response_ids.shape[1] == 5
    sub = exp.select([1]).trimmed()
    assert sub.batch.response_ids.shape[1] == 2
    # token-budget micro-batches count real tokens: P + 5 = 7 per row for row 0
    parts = list(exp.micro_batches(max_seqs=2, max_tokens=7))
    assert [idx.tolist() for idx, _ in parts] == [[0], [1]]
    assert parts[0][1].batch.response_ids.shape[1] == 5


def test_outcome_reward_lands_on_the_last_model_token():
    exp = _multi_turn_batch()
    r = last_token_rewards(torch.tensor([1.0, 2.0]), exp.response_mask)
    assert r.tolist() == [[0, 0, 0, 0, 1.0], [0, 2.0, 0, 0, 0]]
    # an episode whose last tokens are observations: the reward sits on the last model token
    s = Sample(0, [1], [5, 6, 7], [0.0] * 3, [0] * 3, "eos", loss_mask=[1, 0, 0])
    e = Experience.from_samples([s], pad_id=0)
    assert last_token_rewards(torch.tensor([1.0]), e.response_mask).tolist() == [[1.0, 0, 0]]


def test_gae_skips_observation_tokens():
    """delta_t = r_t + gamma V_{t'} - V_t with t' the next *model* token (hand-computed):
    model tokens at 0, 1, 4; V = [1, 2, _, _, 4]; r_4 = 1; gamma = 0.5, lam = 1.
    A_4 = 1 - 4 = -3;  A_1 = 0 + 0.5*4 - 2 + 0.5*(-3) = -1.5;  A_0 = 0 + 0.5*2 - 1 + 0.5*(-1.5)
    = -0.75; observation positions get 0."""
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0]])
    values = torch.tensor([[1.0, 2.0, 9.0, 9.0, 4.0]])
    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0]])
    adv, ret = compute_advantages(
        "gae", token_rewards=rewards, response_mask=mask, values=values, gamma=0.5, lam=1.0
    )
    assert adv.tolist() == [[-0.75, -1.5, 0.0, 0.0, -3.0]]
    assert ret.tolist() == [[0.25, 0.5, 0.0, 0.0, 1.0]]


def test_grpo_advantage_is_zero_on_observation_tokens():
    exp = _multi_turn_batch()
    adv, _ = compute_advantages(
        "grpo",
        token_rewards=last_token_rewards(torch.tensor([1.0, 0.0]), exp.response_mask),
        response_mask=exp.response_mask,
        group_index=exp.group_index,
    )
    assert adv[0, 2] == 0 and adv[0, 3] == 0 and adv[0, 0] > 0 and adv[0, 4] > 0
    assert adv[1, 2:].abs().sum() == 0


def test_loss_mask_of_the_wrong_length_is_a_clear_error():
    s = Sample(7, [1], [5, 6], [0.0] * 2, [0] * 2, "eos", loss_mask=[1])
    with pytest.raises(ValueError, match="sample 7: loss_mask has 1 entries for 2 response"):
        Experience.from_samples([s], pad_id=0)
