"""A separate evaluation replica (``eval.replica: separate``, docs/failures.md).

In ``async`` / ``overlap`` a background evaluation (``relayrl.controller.background_eval``)
shares the rollout engine with training by default: its requests take generation capacity from
training's, and a weight update with interruption re-prefills them under newer weights. With
``eval.replica: separate`` it runs on a :class:`~relayrl.rollout.RolloutEngine` of its own in
the trainer's process instead (``cluster: local``). When an evaluation starts, the trainer's
thread copies the actor's current weights (version ``v``, the steps trained so far) into that
engine (:meth:`EvalReplica.load`: one in-memory copy of the weights, the engine idle since the
previous evaluation finished), then the evaluation's thread generates from them: every token is
of version ``v`` (``eval/version_min == eval/version_max == eval/at_step``) whatever training
does meanwhile. The replica holds one more copy of the model (the engine's, in the compute
dtype on the engine's device).
"""

from __future__ import annotations

from typing import Any

from relayrl.config import RunConfig
from relayrl.rollout import RolloutEngine
from relayrl.workers import Roles
from relayrl.workers.build import engine_model

__all__ = ["EvalReplica"]


class EvalReplica:
    """The evaluation's own engine, holding a snapshot of the actor's weights."""

    def __init__(self, cfg: RunConfig, roles: Roles) -> None:
        if cfg.cluster != "local":
            raise ValueError(
                f"eval.replica: separate needs cluster: local (got cluster: {cfg.cluster}); "
                "use eval.replica: shared"
            )
        self.actor: Any = roles.actor
        tok = roles.tokenizer
        self.engine = RolloutEngine(
            engine_model(cfg.model, self.actor, cfg.model.path),
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            max_slots=cfg.rollout.max_slots,
            max_model_len=cfg.rollout.max_model_len,
            seed=cfg.seed,
            cuda_graphs=cfg.rollout.cuda_graphs,
        )

    def load(self, version: int) -> None:
        """Copy the actor's weights (they are ``version``) into the engine as ``version``;
        call it from the trainer's thread, between steps, with no evaluation running."""
        if version != self.engine.version:
            self.engine.update_weights(self.actor.state_dict(), version=version, interrupt=False)
