"""The calculator tool task: multi-digit multiplication with a ``calculator`` tool.

Rows come from the arithmetic task (``data.arithmetic.operators: ["*"]``, two 2-digit
operands: a tiny model cannot multiply them, it can copy digits). With the tool
(``env.kwargs.tools: true``) the first message announces it (``S:tools:calculator``; a
tokenizer with a chat template gets the schema through the template's ``tools``) and a solved
episode is two turns, in the plain rendering (``relayrl.env.render``)::

    S:tools:calculator
    U:37*58=
    A:<tool_call>{"name":"calculator","arguments":{"expression":"37*58"}}</tool_call><eos>
    T:2146
    A:2146<eos>

Without the tool the prompt has no tools line, a tool call gets ``error: unknown tool``, and
the model must answer from its own weights. The outcome is the run's reward function
(``arithmetic``) on the final assistant turn.
"""

from __future__ import annotations

import ast
import json
import operator
import random
from collections.abc import Mapping, Sequence
from typing import Any

from relayrl.env.tools import ToolEnvironment

TOOLS_LINE = "tools:calculator"
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculator(expression: str) -> str:
    """Evaluate an integer expression with + - * and parentheses.

    Args:
        expression: e.g. "37*58"
    """
    if len(expression) > 64:
        raise ValueError("expression longer than 64 characters")

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        raise ValueError(f"unsupported expression {expression!r}")

    return str(ev(ast.parse(expression.strip(), mode="eval").body))


class CalculatorEnv(ToolEnvironment):
    """The calculator task (see module); ``tools=False`` offers no tool."""

    def __init__(self, tools: bool = True):
        super().__init__([calculator] if tools else [])
        self.with_tools = tools

    async def reset(self, row: Mapping[str, Any]) -> list[dict[str, Any]]:
        head = [{"role": "system", "content": TOOLS_LINE}] if self.with_tools else []
        return [*head, {"role": "user", "content": str(row["prompt"])}]


def make_calculator_env(tools: bool = True) -> CalculatorEnv:
    return CalculatorEnv(tools=tools)


def tool_call_text(expression: str) -> str:
    """The tool call as the task's traces write it (compact JSON)."""
    call = {"name": "calculator", "arguments": {"expression": expression}}
    return f"<tool_call>{json.dumps(call, separators=(',', ':'))}</tool_call>"


def sft_traces(
    rows: Sequence[Any], eos: str, tool_fraction: float = 0.5, seed: int = 0
) -> list[dict]:
    """Synthetic SFT traces (``prompt`` / ``response`` / ``segments`` JSONL records for
    ``relayrl sft``) in the plain rendering: with the tool (call, result, answer) for
    ``tool_fraction`` of the rows, else the direct answer without the tools line. ``eos``: the
    EOS token's text (it ends the model's first turn inside the response; SFT appends the last).
    The tool result and the next turn's header (``T:2146\nA:``) are the environment's
    observation: its segment has ``train: false``, so SFT learns only what the model writes."""
    rng = random.Random(f"relayrl.calculator.sft:{seed}")
    out = []
    for r in rows:
        answer = str(getattr(r, "answer", None) or getattr(r, "response", ""))
        if rng.random() < tool_fraction:
            prompt = f"S:{TOOLS_LINE}\nU:{r.prompt}\nA:"
            expr = r.prompt.rstrip("=")
            segments = [
                (f"{tool_call_text(expr)}{eos}", True),
                (f"T:{calculator(expr)}\nA:", False),
                (answer, True),
            ]
        else:
            prompt, segments = f"U:{r.prompt}\nA:", [(answer, True)]
        out.append(
            {
                "prompt": prompt,
                "response": "".join(t for t, _ in segments),
                "segments": [{"text": t, "train": m} for t, m in segments],
            }
        )
    return out
