"""Multi-turn episodes: environments, tools, token-exact trajectories, the episode runner.

Layer 6 (DESIGN.md): above ``rollout`` / ``reward`` / ``data``, below ``workers`` and
``controller``; it knows nothing of training. See ``environment.py`` for writing an
environment, ``tools.py`` for tools, ``trajectory.py`` for the token-exact trajectory and
``render.py`` for how turns become tokens.
"""

from relayrl.env.environment import Environment, FunctionEnvironment, call_maybe_async
from relayrl.env.render import ChatTemplateRenderer, PlainRenderer, make_renderer
from relayrl.env.tools import ToolCall, ToolEnvironment, Toolset, parse_tool_calls, tool_schema
from relayrl.env.trajectory import PrefixViolation, Segment, TrajectoryBuilder
from relayrl.env.types import (
    STOP_REASONS,
    EnvError,
    Message,
    StepResult,
    StopReason,
    ToolError,
    as_step_result,
    check_messages,
)

__all__ = [
    "STOP_REASONS",
    "ChatTemplateRenderer",
    "EnvError",
    "Environment",
    "FunctionEnvironment",
    "Message",
    "PlainRenderer",
    "PrefixViolation",
    "Segment",
    "StepResult",
    "StopReason",
    "ToolCall",
    "ToolEnvironment",
    "ToolError",
    "Toolset",
    "TrajectoryBuilder",
    "as_step_result",
    "call_maybe_async",
    "check_messages",
    "make_renderer",
    "parse_tool_calls",
    "tool_schema",
]
