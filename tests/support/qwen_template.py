"""A Qwen2.5-style chat template (the Qwen2.5 instruct models' template, tool calls included)
on the tiny character tokenizer with ``<|im_start|>`` / ``<|im_end|>`` (and optionally the tool
tags) as special tokens, and a scripted engine that replies with given texts."""

from __future__ import annotations

from collections import Counter
from typing import Any

from relayrl.model.tiny import build_char_tokenizer
from relayrl.rollout.types import EngineReport, Sample

QWEN25_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n"
    "    {%- endif %}\n"
    '    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user '
    "query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:"
    '\\n<tools>" }}\n'
    "    {%- for tool in tools %}\n"
    '        {{- "\\n" }}\n'
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name '
    'and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": '
    '<function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n'
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    '    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or '
    '(message.role == "assistant" and not message.tool_calls) %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + "
    "'\\n' }}\n"
    '    {%- elif message.role == "assistant" %}\n'
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    '            {{- \'\\n<tool_call>\\n{"name": "\' }}\n'
    "            {{- tool_call.name }}\n"
    '            {{- \'", "arguments": \' }}\n'
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    '    {%- elif message.role == "tool" %}\n'
    '        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}\n'
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    '        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n'
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

# A minimal chat template (a role letter, the content, "A: " to answer): short prompts for the
# tests that train through a template ("U: 3+5=\nA: ").
ROLE_TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] | upper }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}A: {% endif %}"
)

QWEN_CHARS = (
    "0123456789+-*/=?.,:;!()<>[]{}'\"_ \n#|\\abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
)


def qwen_tokenizer(special_tool_tags: bool = False) -> Any:
    """The character tokenizer with the Qwen2.5 template; ``<|im_start|>`` / ``<|im_end|>``
    (and, with ``special_tool_tags``, ``<tool_call>`` / ``</tool_call>``) are special tokens."""
    tok = build_char_tokenizer(QWEN_CHARS)
    specials = ["<|im_start|>", "<|im_end|>"]
    if special_tool_tags:
        specials += ["<tool_call>", "</tool_call>"]
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.chat_template = QWEN25_TEMPLATE
    return tok


class ScriptedEngine:
    """A ``relayrl.rollout.SteppingEngine`` (``submit`` / ``step``): turn k of every episode
    replies ``replies[k]`` (tokenised, then ``<|im_end|>``), logprob -1, version 0. Nothing
    streams (``progress`` None) and nothing aborts (a reply is whole at once); no context
    length (``max_model_len`` None: the caller's limits hold)."""

    max_slots = 64
    max_model_len = None

    def __init__(self, tok: Any, replies: list[str], end: bool = True):
        self.tok, self.replies, self.end = tok, replies, end
        self.end_id = tok.convert_tokens_to_ids("<|im_end|>")
        self.turns: Counter[int] = Counter()
        self.pending: list[Any] = []
        self.contexts: list[list[int]] = []
        self.version = 0  # stamped on every token

    def submit(self, req: Any) -> int:
        self.pending.append(req)
        return len(self.contexts) + len(self.pending) - 1

    def has_unfinished(self) -> bool:
        return bool(self.pending)

    def step(self) -> list[Sample]:
        out = []
        for req in self.pending:
            if "_env_episode" in req.metadata:
                eid = req.metadata["_env_episode"]
                turn = self.turns[eid]
                self.turns[eid] += 1
            else:  # a call through the endpoint: its turn is its prompt's assistant turns
                turn = self.tok.decode(req.prompt_ids).count("<|im_start|>assistant") - 1
            text = self.replies[min(turn, len(self.replies) - 1)]
            ids = list(self.tok(text, add_special_tokens=False)["input_ids"])
            ids += [self.end_id] if self.end else []
            self.contexts.append(list(req.prompt_ids))
            out.append(
                Sample(
                    len(self.contexts) - 1,
                    list(req.prompt_ids),
                    ids,
                    [-1.0] * len(ids),
                    [self.version] * len(ids),
                    "stop",
                    req.group_id,
                    dict(req.metadata),
                )
            )
        self.pending = []
        return out

    def generate(self, requests: list[Any]) -> list[Sample]:
        for r in requests:
            self.submit(r)
        return self.step()

    def abort(self, request_id: int) -> bool:
        return False

    def progress(self, request_id: int, start: int = 0) -> None:
        return None

    def update_weights(self, state_dict: Any, version: int, interrupt: bool = True) -> None:
        self.version = version

    def prioritize(self, group_ids: Any) -> None:
        pass

    def stats(self) -> dict[str, Any]:
        return {"requests": len(self.contexts)}

    def report(self) -> EngineReport:
        return EngineReport(self.stats())

    def close(self) -> None:
        pass
