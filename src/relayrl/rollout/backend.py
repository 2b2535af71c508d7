"""The rollout seam: what every backend in the rollout slot (``Roles.rollout``) implements.

Implementations: the own engine (:class:`~relayrl.rollout.RolloutEngine`), vLLM in process
(``VllmEngine``) and as a server (``VllmServerEngine``), the engine in a worker process
(``cluster.engine_process.EngineProcess``), Ray replicas (``cluster.ray_rollout.
RayRolloutClient``), and the wrappers that look like an engine to the controller: the episode
runner (``env.runner.EpisodeRunner``) and the agent rollout (``env.agent_rollout.
AgentRollout``). The controller, schedules and environments call these methods and nothing
else; an optional capability is a separate protocol checked once with ``isinstance``.

Two ways to drive one, each a protocol of its own: a :class:`SteppingEngine` computes in the
caller's thread (``submit`` -> id, ``step`` -> finished samples); a :class:`PollingBackend`
computes elsewhere (``submit_many``, ``poll(timeout)`` -> finished samples). No backend is both.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol, runtime_checkable

from torch import Tensor

from relayrl.rollout.types import EngineReport, GenerationRequest, Sample

__all__ = [
    "EpisodeMetrics",
    "LivePollingBackend",
    "PollingBackend",
    "RolloutBackend",
    "SteppingEngine",
    "driven",
]


@runtime_checkable
class RolloutBackend(Protocol):
    """A rollout backend: token ids in, :class:`~relayrl.rollout.Sample` out.

    The contract:

    - Every finished sample carries, per response token, the sampled id, its behaviour
      logprob (the log-probability under the exact distribution it was drawn from) and the
      policy version of the weights that produced it (``Sample.versions``).
    - ``version`` is the policy version of the current weights: the ``version`` of the last
      ``update_weights`` (the constructor's before one); requests admitted from then on are
      generated with them.
    - ``update_weights(state, version, interrupt)``: ``interrupt=True``: in-flight sequences
      continue under the new weights (re-prefilled; their later tokens carry the new
      version); ``interrupt=False``: in-flight sequences finish under the weights they
      started with. A backend that cannot keep old weights documents how it maps the flag.
    - A request the backend cannot run (empty or too long prompt, bad ids) never takes other
      requests down: ``submit`` raises ``ValueError`` (a stepping engine), or the request comes
      back as an ``'abort'`` sample with ``error`` set, or through ``rejected()`` (polling).
    """

    @property
    def version(self) -> int:
        """The policy version of the current weights (see the class)."""
        ...

    @property
    def max_slots(self) -> int | None:
        """Sequences one engine decodes at once; None when the backend does not know (a
        pool of replicas: the caller uses ``rollout.max_slots``)."""
        ...

    @property
    def max_model_len(self) -> int | None:
        """The context length (prompt + response tokens); None when the backend does not
        know (a client of an engine elsewhere: the caller reads the model config)."""
        ...

    def submit(self, request: GenerationRequest) -> int | None:
        """Queue one request; its sample comes out of ``step`` / ``poll``. A stepping engine
        returns the request id (``abort`` / ``progress`` take it); a polling one None."""
        ...

    def generate(self, requests: list[GenerationRequest]) -> list[Sample]:
        """Blocking: run ``requests`` to their end; their samples in request order (other
        requests in flight keep going)."""
        ...

    def update_weights(
        self, state_dict: Mapping[str, Tensor], version: int, interrupt: bool = True
    ) -> None:
        """Load new weights as ``version`` (see the class for ``interrupt``)."""
        ...

    def prioritize(self, group_ids: Iterable[int]) -> None:
        """Make the requests of these groups urgent (a trainer waits for them); an empty
        iterable ends it. A backend without urgent steps does nothing."""
        ...

    def report(self) -> EngineReport:
        """Counters since the start and the busy spans since the last report."""
        ...

    def close(self) -> None:
        """Stop what the backend started (processes, threads, servers); idempotent. An engine
        in the caller's process with nothing to stop does nothing."""
        ...


@runtime_checkable
class SteppingEngine(RolloutBackend, Protocol):
    """A backend that computes in the caller's thread, one ``step`` at a time (the own
    engine, vLLM in process or behind a server). Single-threaded: call it from one thread."""

    def submit(self, request: GenerationRequest) -> int:
        """Queue a request; its id. Raises ``ValueError`` (``InvalidRequestError``) on bad
        input, with nothing enqueued."""
        ...

    def step(self) -> list[Sample]:
        """One scheduler step; the samples finished in it (and those aborted since)."""
        ...

    def has_unfinished(self) -> bool:
        """True while a submitted request has not been returned by ``step``."""
        ...

    def abort(self, request_id: int) -> bool:
        """Stop a live request; its ``'abort'`` sample (tokens so far) comes out of the next
        ``step``. False when the id is not live."""
        ...

    def progress(
        self, request_id: int, start: int = 0
    ) -> tuple[list[int], list[float], list[int]] | None:
        """A running request's response tokens from index ``start`` on, as (ids, behaviour
        logprobs, versions), and a fourth element, their alternatives, for a request with
        ``top_logprobs``; for a streaming caller between steps; None when it is not running,
        or when the engine streams nothing before a request finishes (the sample then carries
        every token)."""
        ...

    def stats(self) -> dict[str, Any]:
        """Counters and timings since construction (``report().counters``)."""
        ...


@runtime_checkable
class PollingBackend(RolloutBackend, Protocol):
    """A backend that computes elsewhere (a worker process, Ray replicas, the episode and
    agent runners); safe to call from several threads."""

    def submit(self, request: GenerationRequest) -> None:
        """``submit_many([request])``."""
        ...

    def submit_many(self, requests: Iterable[GenerationRequest]) -> None:
        """Queue requests; their samples come out of ``poll``."""
        ...

    def poll(self, timeout: float = 0.0) -> list[Sample]:
        """Samples finished so far (waits up to ``timeout`` seconds for the first one)."""
        ...

    def rejected(self) -> list[tuple[GenerationRequest, str]]:
        """(request, error) of the requests refused since the last call (their samples never
        come out of ``poll``); empty for a backend that hands a bad request back as an
        ``'abort'`` sample instead. A caller that reads no rejections waits for those
        requests forever: the async rollout controller turns each into the ``'abort'``
        sample :func:`~relayrl.rollout.types.error_sample` (an infrastructure failure,
        ``engine``)."""
        ...


@runtime_checkable
class LivePollingBackend(PollingBackend, Protocol):
    """A polling backend whose requests can be streamed and aborted while they run, under a
    key the caller picks (the engine-process client)."""

    def submit_live(self, request: GenerationRequest, key: int, stream: bool = True) -> None:
        """Submit ``request`` under ``key`` (unique among live requests): ``abort(key)`` stops
        it, and when ``stream`` its tokens are read with ``progress(key, start)`` while it
        runs. Its sample comes out of ``poll``."""
        ...

    def progress(self, key: int, start: int = 0) -> tuple[list[int], list[float], list[int]] | None:
        """A streamed live request's tokens from index ``start`` on, as (ids, behaviour
        logprobs, versions), and their alternatives for a request with ``top_logprobs``; None
        before the backend accepted it and once its sample arrived."""
        ...

    def abort(self, key: int) -> bool:
        """Stop the live request ``key``: its ``'abort'`` sample comes out of ``poll``. False
        when its sample already arrived."""
        ...


@runtime_checkable
class EpisodeMetrics(Protocol):
    """A backend that runs episodes (the episode runner, the agent rollout): its ``env/*``
    counters, logged once per step by the schedules."""

    def env_metrics(self) -> dict[str, float]:
        """``env/*`` counters since the last call."""
        ...


def driven(backend: RolloutBackend) -> SteppingEngine | PollingBackend:
    """``backend`` as the protocol a wrapper drives it by (a wrapper checks this once, when it
    is built); a ``TypeError`` naming its class when it is neither."""
    if isinstance(backend, SteppingEngine | PollingBackend):
        return backend
    raise TypeError(
        f"{type(backend).__name__} is neither a SteppingEngine (submit / step) nor a "
        "PollingBackend (submit_many / poll): nothing can drive it"
    )
