"""Token-exact multi-turn trajectories.

A trajectory is built from the exact token ids the engine saw and produced, never from text:

- each assistant turn is generated from ``builder.context`` (every token so far, as ids) and
  appended as the engine returned it, with its behaviour logprobs and per-token versions
  (loss mask 1);
- observation tokens (tool results, user feedback, the next turn's opening) are appended as
  the renderer produced them (loss mask 0, logprob 0, version of the model token before them);
  earlier turns are never rendered or tokenised again.

The prefix property (every turn's context starts with the previous context, token for
token) is checked at every turn: ``add_turn`` raises :class:`PrefixViolation` if the engine was
given anything but ``context`` (a bug, never a model's doing), and ``extend_to`` (a renderer
that re-renders the whole conversation, e.g. a chat template) starts a new *segment* where the
new rendering does not start with the old context: the old segment stays a training sample of
its own, the new one starts with the new rendering as its prompt, and ``prefix_breaks`` counts
it (as prime-rl does), instead of training on tokens the model did not produce.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


class PrefixViolation(RuntimeError):
    """A turn was generated from a context other than the trajectory's own token ids."""


@dataclass
class Segment:
    """One training sample of a trajectory: a prompt and everything after it."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    @property
    def num_model_tokens(self) -> int:
        return sum(self.loss_mask)


class TrajectoryBuilder:
    """Accumulates an episode's token ids, loss mask, behaviour logprobs and versions."""

    def __init__(self, prompt_ids: Sequence[int]):
        if not prompt_ids:
            raise ValueError("a trajectory needs a non-empty first prompt")
        self.segments: list[Segment] = [Segment(list(prompt_ids))]
        self.prefix_breaks = 0
        self.turns = 0
        self._last_version = -1

    @property
    def current(self) -> Segment:
        return self.segments[-1]

    @property
    def context(self) -> list[int]:
        """The token ids the next assistant turn is generated from (current segment)."""
        return self.current.context

    @property
    def total_tokens(self) -> int:
        """First prompt + every token appended since (all segments): the token budget's count."""
        first = len(self.segments[0].prompt_ids)
        return first + sum(len(s.response_ids) for s in self.segments)

    def add_turn(
        self,
        context_ids: Sequence[int],
        response_ids: Sequence[int],
        logprobs: Sequence[float],
        versions: Sequence[int],
    ) -> None:
        """Append an assistant turn generated from ``context_ids`` (must equal ``context``)."""
        if list(context_ids) != self.context:
            raise PrefixViolation(
                f"turn {self.turns + 1} was generated from {len(context_ids)} tokens that are not "
                f"the trajectory's {len(self.context)}-token context"
            )
        n = len(response_ids)
        if len(logprobs) != n or len(versions) != n:
            raise ValueError(
                f"turn {self.turns + 1}: {n} tokens but {len(logprobs)} logprobs and "
                f"{len(versions)} versions"
            )
        seg = self.current
        seg.response_ids.extend(int(t) for t in response_ids)
        seg.loss_mask.extend([1] * n)
        seg.logprobs.extend(float(x) for x in logprobs)
        seg.versions.extend(int(v) for v in versions)
        if n:
            self._last_version = int(versions[-1])
        self.turns += 1

    def add_observation(self, ids: Sequence[int]) -> None:
        """Append observation tokens (loss mask 0) exactly as rendered."""
        seg = self.current
        n = len(ids)
        seg.response_ids.extend(int(t) for t in ids)
        seg.loss_mask.extend([0] * n)
        seg.logprobs.extend([0.0] * n)
        seg.versions.extend([self._last_version] * n)

    def extend_to(self, full_ids: Sequence[int]) -> bool:
        """The next context as a full re-rendering: if it starts with ``context``, append the
        rest as observation tokens and return True; else start a new segment with it as the
        prompt, count a prefix break and return False."""
        full = list(full_ids)
        ctx = self.context
        if len(full) >= len(ctx) and full[: len(ctx)] == ctx:
            self.add_observation(full[len(ctx) :])
            return True
        self.prefix_breaks += 1
        self.segments.append(Segment(full))
        return False

    def trained_segments(self) -> list[Segment]:
        """The segments holding at least one model token (what becomes training samples)."""
        return [s for s in self.segments if s.num_model_tokens > 0]
