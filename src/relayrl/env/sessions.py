"""Per-session recording of the endpoint's calls, and their trajectories.

A session (one agent rollout) records every call it makes through the OpenAI-compatible
endpoint: the prompt token ids the server rendered, the completion ids, behaviour logprobs
and versions exactly as the engine returned them (:class:`CallRecord`).

Trajectories. Each call is placed when it finishes:

- if its prompt starts, token for token, with the full context (prompt + everything after
  it) of one of the session's trajectories, it *extends* that trajectory: the tokens between
  that context and the new prompt (tool results, the next user turn, the template's turn
  markers) are appended with loss mask 0, then the completion with mask 1
  (:class:`relayrl.env.trajectory.TrajectoryBuilder`, one builder per trajectory; the longest
  matching context wins);
- otherwise it starts a new trajectory and counts a ``prefix_break``: the agent branched
  (two calls from one context, a rewritten history) or the re-rendering of an earlier turn
  differs from the tokens the model generated (re-tokenisation drift, a template that drops
  earlier reasoning, a completion cut by ``max_tokens`` that the template closes).

So a linear conversation is one training sample (model tokens mask 1, everything else 0) and
a branching one is one sample per branch (one per call when every call branches). No token
the model did not produce is ever trained on.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from relayrl.env.trajectory import TrajectoryBuilder
from relayrl.rollout.types import Sample


@dataclass
class CallRecord:
    """One endpoint call of a session, as the engine saw and produced it."""

    kind: str  # "chat" | "completion"
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    sampling: dict[str, Any] = field(default_factory=dict)  # temperature, top_p, top_k, seed, ...
    trajectory: int = -1  # index into Session.trajectories
    extended: bool = False  # True when it extended an earlier call's trajectory
    response_id: str = ""  # the reply's id (chatcmpl-... / cmpl-...): per-call rewards' key
    segment: int = 0  # the trajectory segment holding it
    span: tuple[int, int] = (0, 0)  # where its completion sits in that segment's response
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per token, when asked (reply)


@dataclass
class Session:
    """One rollout's recorded calls (see module). ``sampling`` holds the sampling settings
    the server enforces for this session (training: the rollout config's temperature,
    top_p, top_k, a max_tokens cap, and a seed from which each call's seed is derived)."""

    key: str
    sampling: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    calls: list[CallRecord] = field(default_factory=list)
    trajectories: list[TrajectoryBuilder] = field(default_factory=list)
    prefix_breaks: int = 0
    errors: int = 0  # calls answered with an error (bad input, context overflow)
    _submitted: int = field(default=0, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def next_seed(self) -> int | None:
        """The seed of the next call: ``(sampling['seed'] * 1_000_003 + n) mod 2^31`` for the
        session's n-th submitted call (n from 0); None without a session seed (the engine
        draws one)."""
        base = self.sampling.get("seed")
        if base is None:
            return None
        with self._lock:
            n = self._submitted
            self._submitted += 1
        return (int(base) * 1_000_003 + n) & 0x7FFFFFFF

    def record(self, call: CallRecord) -> CallRecord:
        """Add a finished call and place it on a trajectory (see module)."""
        with self._lock:
            best, best_len = -1, -1
            for i, t in enumerate(self.trajectories):
                ctx = t.context
                if len(ctx) > best_len and call.prompt_ids[: len(ctx)] == ctx:
                    best, best_len = i, len(ctx)
            if best >= 0:
                traj = self.trajectories[best]
                traj.extend_to(call.prompt_ids)  # prefix checked above: appends mask-0 tokens
                call.extended = True
            else:
                if self.trajectories:
                    self.prefix_breaks += 1
                traj = TrajectoryBuilder(call.prompt_ids)
                self.trajectories.append(traj)
                best = len(self.trajectories) - 1
            start = len(traj.current.response_ids)
            traj.add_turn(call.prompt_ids, call.completion_ids, call.logprobs, call.versions)
            call.segment, call.span = (
                len(traj.segments) - 1,
                (start, len(traj.current.response_ids)),
            )
            call.trajectory = best
            self.calls.append(call)
            return call

    def count_error(self) -> None:
        with self._lock:
            self.errors += 1

    def stats(self) -> dict[str, float]:
        """``calls``, ``trajectories``, ``prefix_breaks``, ``errors``, model / other tokens."""
        with self._lock:
            model = sum(s.num_model_tokens for t in self.trajectories for s in t.segments)
            total = sum(len(s.response_ids) for t in self.trajectories for s in t.segments)
            return {
                "calls": float(len(self.calls)),
                "trajectories": float(len(self.trajectories)),
                "prefix_breaks": float(self.prefix_breaks),
                "errors": float(self.errors),
                "model_tokens": float(model),
                "observation_tokens": float(total - model),
            }

    def to_samples(
        self,
        request_id: int = -1,
        group_id: int | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> list[Sample]:
        """One :class:`Sample` per trajectory segment with a model token: the first prompt,
        then every later token with its loss mask, the engine's behaviour logprobs and
        versions (observation tokens: logprob 0, the version of the model token before)."""
        with self._lock:
            out = []
            for t_index, traj in enumerate(self.trajectories):
                last = [c for c in self.calls if c.trajectory == t_index][-1]
                for seg in traj.trained_segments():
                    meta = {**(metadata or {}), "agent_trajectory": t_index}
                    out.append(
                        Sample(
                            request_id=request_id,
                            prompt_ids=list(seg.prompt_ids),
                            response_ids=list(seg.response_ids),
                            behaviour_logprobs=list(seg.logprobs),
                            versions=list(seg.versions),
                            finish_reason=last.finish_reason,  # type: ignore[arg-type]
                            group_id=group_id,
                            metadata=meta,
                            loss_mask=list(seg.loss_mask),
                        )
                    )
            return out


class SessionStore:
    """The server's open sessions, by key (thread-safe)."""

    def __init__(self) -> None:
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()

    def open(
        self,
        key: str | None = None,
        sampling: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> Session:
        """A new session (a random key unless given; an open key raises ``ValueError``)."""
        key = key or "sess-" + secrets.token_hex(8)
        if not key.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"session key {key!r}: use letters, digits, '-' and '_' only")
        with self._lock:
            if key in self._sessions:
                raise ValueError(f"session {key!r} is already open")
            s = Session(key, dict(sampling or {}), dict(metadata or {}))
            self._sessions[key] = s
            return s

    def get(self, key: str) -> Session | None:
        with self._lock:
            return self._sessions.get(key)

    def close(self, key: str) -> Session | None:
        """Forget the session (later calls with its key are refused) and return it."""
        with self._lock:
            return self._sessions.pop(key, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)
