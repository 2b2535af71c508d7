"""Tool calls under a real Qwen2.5-style chat template on the environment path: each call is
rendered once, the next turn extends the generated ids (0 prefix breaks, also when the model's
JSON is not the template's canonical spacing), tool tags that are special tokens are parsed,
and a real engine on a real (tiny Qwen2) model keeps the prefix property at every turn."""

from __future__ import annotations

import asyncio

import pytest

from qwen_template import ScriptedEngine, qwen_tokenizer
from relayrl.env import ChatTemplateRenderer, FunctionEnvironment, StepResult
from relayrl.env.builtin.calculator import CalculatorEnv
from relayrl.env.runner import EpisodeRunner, RunnerLimits
from relayrl.rollout import GenerationRequest, RolloutEngine, SamplingParams

CANONICAL = (
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>'
)
COMPACT = '<tool_call>{"name":"calculator","arguments":{"expression":"12*34"}}</tool_call>'


def _requests(n: int) -> list[GenerationRequest]:
    return [
        GenerationRequest(
            [1],
            SamplingParams(max_tokens=200, seed=i),
            group_id=i,
            metadata={"prompt": "12*34=", "answer": "408"},
        )
        for i in range(n)
    ]


def _run(tok, replies, incremental=True, n=4):
    engine = ScriptedEngine(tok, replies)
    runner = EpisodeRunner(
        engine,
        CalculatorEnv,
        ChatTemplateRenderer(tok, incremental=incremental),
        RunnerLimits(max_turns=3, max_model_len=4096),
    )
    try:
        return runner.generate(_requests(n)), runner.env_metrics()
    finally:
        runner.close()


def _conversation(reply: str, content: str = "") -> list[dict]:
    call = {"name": "calculator", "arguments": {"expression": "12*34"}}
    first = asyncio.run(CalculatorEnv().reset({"prompt": "12*34=", "answer": "408"}))
    return [
        *first,
        {
            "role": "assistant",
            "content": content,
            "tool_calls": [{"id": "call_0", "type": "function", "function": call}],
        },
        {"role": "tool", "content": "408", "name": "calculator", "tool_call_id": "call_0"},
        {"role": "assistant", "content": reply},
    ]


@pytest.mark.parametrize("incremental", [True, False], ids=["bridge", "rerender"])
def test_a_canonical_call_is_rendered_once_and_training_sees_what_deployment_sees(incremental):
    tok = qwen_tokenizer()
    samples, m = _run(tok, [CANONICAL, "408"], incremental)
    assert (
        m.get("env/prefix_breaks", 0) == 0
        and m["env/tool_calls"] == 4
        and m.get("env/tool_errors", 0) == 0
    )
    tools = CalculatorEnv().tools
    deployed = tok.apply_chat_template(_conversation("408"), tools=tools, tokenize=False)
    for s in samples:
        assert s.metadata["env"]["turns"] == 2 and s.metadata["env"]["stop_reason"] == "env_done"
        text = tok.decode(s.prompt_ids + s.response_ids)
        assert text + "\n" == deployed  # what the template renders at deployment
        assert text.count('{"name": "calculator", "arguments"') == 1  # the call, once
        # the model's tokens are trained, the template's bridge and the tool's are not
        trained = tok.decode([t for t, k in zip(s.response_ids, s.loss_mask, strict=True) if k])
        assert trained == CANONICAL + "<|im_end|>" + "408<|im_end|>"


def test_a_non_canonical_call_keeps_the_prefix_when_bridged_and_breaks_it_when_rerendered():
    tok = qwen_tokenizer()
    _, bridged = _run(tok, [COMPACT, "408"], incremental=True)
    _, rerendered = _run(tok, [COMPACT, "408"], incremental=False)
    assert bridged.get("env/prefix_breaks", 0) == 0 and bridged["env/tool_calls"] == 4
    assert rerendered["env/prefix_breaks"] == 4  # the template re-spaces the model's JSON


def test_tool_tags_that_are_special_tokens_are_parsed():
    tok = qwen_tokenizer(special_tool_tags=True)
    ids = tok(CANONICAL, add_special_tokens=False)["input_ids"]
    assert tok.convert_tokens_to_ids("<tool_call>") in ids  # one special token, not 11 chars
    samples, m = _run(tok, [CANONICAL, "408"])
    assert (
        m["env/tool_calls"] == 4
        and m.get("env/tool_errors", 0) == 0
        and m.get("env/prefix_breaks", 0) == 0
    )
    for s in samples:
        assert "<tool_response>\n408\n</tool_response>" in tok.decode(s.response_ids)


def test_a_truncated_turn_is_closed_by_the_bridge():
    """A turn cut by max tokens (no <|im_end|>): the bridge appends the template's closing
    text (untrained) before the observation."""
    tok = qwen_tokenizer()
    engine = ScriptedEngine(tok, [CANONICAL, "408"], end=False)
    runner = EpisodeRunner(
        engine,
        CalculatorEnv,
        ChatTemplateRenderer(tok),
        RunnerLimits(max_turns=3, max_model_len=4096),
    )
    try:
        (s,) = runner.generate(_requests(1))
    finally:
        runner.close()
    text = tok.decode(s.response_ids)
    assert "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>" in text
    assert s.metadata["env"]["prefix_breaks"] == 0


@pytest.fixture(scope="module")
def qwen_model(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = qwen_tokenizer(special_tool_tags=True)
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    import torch

    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).eval(), tok


def test_a_real_engine_on_a_tiny_qwen2_keeps_the_prefix_at_every_turn(qwen_model):
    model, tok = qwen_model
    im_end = tok.convert_tokens_to_ids("<|im_end|>")

    def step(message, state):
        state["n"] = state.get("n", 0) + 1
        obs = [{"role": "tool", "content": f"result {state['n']}"}]
        return StepResult(obs, done=state["n"] >= 3)

    def factory():
        return FunctionEnvironment(
            lambda row, st: [{"role": "user", "content": row["prompt"]}], step
        )

    engine = RolloutEngine(
        model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, max_slots=4
    )
    runner = EpisodeRunner(
        engine,
        factory,
        ChatTemplateRenderer(tok),
        RunnerLimits(max_turns=3, max_turn_tokens=12, max_model_len=1024),
    )
    reqs = [
        GenerationRequest(
            [1], SamplingParams(max_tokens=12, seed=i), group_id=i, metadata={"prompt": "hi"}
        )
        for i in range(8)
    ]
    assert im_end in runner.renderer.stop_ids
    try:
        samples = runner.generate(reqs)
        m = runner.env_metrics()
    finally:
        runner.close()
    assert m.get("env/prefix_breaks", 0) == 0 and m["env/turns"] == 24
    for s in samples:
        assert s.metadata["env"]["turns"] == 3 and not s.metadata["env"]["segments"]
        assert tok.decode(s.response_ids).count("<|im_start|>user\n<tool_response>") == 2


def test_the_start_up_check_names_a_template_problem():
    from relayrl.env.render import PlainRenderer
    from relayrl.env.template_check import check_tool_template

    for special in (False, True):
        c = check_tool_template(ChatTemplateRenderer(qwen_tokenizer(special)))
        assert c.parses and c.bridge_holds and c.rerender_holds and c.problem is None
    # tags decoded away (as skip_special_tokens=True did): the check says the calls are lost
    r = ChatTemplateRenderer(qwen_tokenizer(special_tool_tags=True))
    r.assistant_text = lambda ids: r.tokenizer.decode(ids, skip_special_tokens=True)
    c = check_tool_template(r)
    assert not c.parses and "would not reach the tools" in (c.problem or "")
    # a template without tool support
    tok = qwen_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}\n{% endfor %}"
    c = check_tool_template(ChatTemplateRenderer(tok))
    assert c.problem == "the chat template renders no tool calls (it ignores tool_calls)"
    assert PlainRenderer  # the plain rendering is not checked (no template)


def test_the_endpoint_parses_tool_tags_that_are_special_tokens():
    from relayrl.env.agent_chat import ChatRendering

    tok = qwen_tokenizer(special_tool_tags=True)
    chat = ChatRendering(tok)
    ids = tok(CANONICAL, add_special_tokens=False)["input_ids"]
    ids += [tok.convert_tokens_to_ids("<|im_end|>")]
    msg = chat.message(ids, parse_tools=True)
    assert msg["content"] is None and len(msg["tool_calls"]) == 1
    assert msg["tool_calls"][0]["function"]["name"] == "calculator"


def test_grpo_trains_the_calculator_through_the_qwen_template(tmp_path):
    """The environment path end to end under the Qwen2.5 template (tool schemas in the
    system turn, the bridge after each turn): 2 GRPO steps of a random model, no failure, 0
    prefix breaks (the scripted tests above make the tool calls a random model does not)."""
    import json

    from transformers import LlamaConfig, LlamaForCausalLM

    from helpers import run_config
    from relayrl.cluster.local import build_local_roles
    from relayrl.controller.trainer import train

    tok = qwen_tokenizer(special_tool_tags=True)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    run = tmp_path / "run"
    rc = run_config(
        tmp_path / "m",
        run,
        "data.arithmetic.operators=['*']",
        "data.eval_size=2",
        "env.factory=calculator",
        "env.max_turns=2",
        "rollout.max_tokens=8",
        "algo.prompts_per_step=2",
        "algo.group_size=2",
        "train.steps=2",
        "train.save_every=0",
    )
    train(rc, lambda a, c: build_local_roles(rc, a, c))
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "reward_mean" in r]
    assert len(steps) == 2 and all(r["env/episodes"] == 4 for r in steps)
    assert sum(r.get("env/prefix_breaks", 0) for r in recs) == 0
    assert sum(r.get("env/failures", 0) for r in recs) == 0
