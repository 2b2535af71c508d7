"""pi_old and the off-policy correction weights of a step: the one place that decides them.

Three logprobs of every sampled token meet here: pi_behav (the engine's, at sampling time,
``Experience.behaviour_logprobs``), pi_old / pi_prox (the trainer's before the update,
``Experience.old_logprobs``) and pi_theta (the update's own forward). What they are depends on
the schedule (``sync``: fresh data; ``overlap`` / ``async``: possibly stale), on
``algo.recompute_old_logprobs`` / epochs / mini-batches and on how the registered policy loss
meets stale data (``PolicyLoss.off_policy``, :mod:`relayrl.algos.registry`):

- :func:`old_logprobs` (phase 3 of a step) decides pi_old;
- :func:`correct` (phase 5, before the update) sets ``Experience.rollout_weights``, the
  constant per-token weights of the policy loss: the rollout correction
  (``algo.rollout_correction``, rho = pi_trainer / pi_engine) and, for a loss with
  ``off_policy="weight"`` off the sync schedule, decoupled PPO's behaviour weight
  f(pi_prox / pi_behav); and logs the train / inference mismatch (``rollout_corr/*``,
  ``offpolicy/*``, ``mismatch/*``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from relayrl.algos import behaviour_weights, get_policy_loss, rollout_correction
from relayrl.config import RunConfig
from relayrl.telemetry.mismatch import MismatchMonitor
from relayrl.workers import Experience, Roles


def naive_ppo(cfg: RunConfig) -> bool:
    """pi_old is the engine's behaviour logprobs: a loss with ``off_policy="behaviour"`` (naive
    ``ppo``) off the sync schedule (AReaL's "naive PPO" baseline)."""
    return cfg.schedule != "sync" and get_policy_loss(cfg.policy_loss).off_policy == "behaviour"


def old_logprobs(
    roles: Roles, exp: Experience, cfg: RunConfig, needed_now: bool = False
) -> Tensor | None:
    """pi_old of the ratio for this batch.

    - ``needed_now`` (PPO-RLHF: the KL in the reward reads them before the update): the
      pre-update actor's logprobs, recomputed here;
    - naive PPO on possibly stale data (``policy_loss: ppo`` in ``overlap`` / ``async``):
      the behaviour policy's logprobs, as the engine reported them (the clip is centred on
      the policy that generated the tokens);
    - one update per step (``recompute_old_logprobs: auto``, epochs = mini_batches = 1):
      None, and the actor takes its own detached logprobs in the update's forward, micro-batch
      by micro-batch: they are the pre-update policy's (``ActorWorker.update``; it computes
      them first itself when its model has dropout). This holds for decoupled PPO's pi_prox
      off the sync schedule too: its ratio pi_theta / pi_prox is then exactly 1 at the
      forward, its behaviour weight exp(pi_prox - pi_behav) the same numbers, one forward
      fewer per step;
    - otherwise the pre-update actor's logprobs, recomputed here (decoupled PPO's proximal
      policy pi_prox; on fresh data equal to the behaviour logprobs).
    """
    a = cfg.algo
    if needed_now:
        return roles.actor.compute_logprobs(exp)
    if naive_ppo(cfg):
        return exp.behaviour_logprobs
    if a.recompute_old_logprobs == "auto" and a.epochs == 1 and a.mini_batches == 1:
        return None
    return roles.actor.compute_logprobs(exp)


def needs_behaviour_weight(cfg: RunConfig) -> bool:
    """Whether the loss gets decoupled PPO's behaviour weight from :func:`correct_rollout`: a
    loss with ``off_policy="weight"`` (gspo, cispo, sapo, gmpo, a new loss by default) off the
    sync schedule (data can be stale, so the off-policy correction is on by default, as
    ``decoupled_ppo`` is) unless ``algo.rollout_correction.mode`` is set, whose weight (the
    same ratio pi_prox / pi_behav) then replaces it, as for decoupled PPO. The weight is f(w),
    w = exp(pi_prox - pi_behav), f from ``algo.behav_weight_mode`` / ``behav_weight_cap`` /
    ``behav_weight_lower``."""
    return (
        cfg.schedule != "sync"
        and get_policy_loss(cfg.policy_loss).off_policy == "weight"
        and cfg.algo.rollout_correction.mode == "none"
    )


def trainer_logprobs(roles: Roles, exp: Experience, cfg: RunConfig, compute: bool) -> Tensor | None:
    """The trainer's logprobs of the batch at the start of the step (pi_old / pi_prox).

    Reused from ``exp.old_logprobs`` when the actor computed them (not for naive PPO off the
    sync schedule, whose pi_old is the engine's). Otherwise, with ``compute``, one actor
    forward; they also become ``old_logprobs`` when the step had none (identical values to the
    update's own detached logprobs), else None.
    """
    if exp.old_logprobs is not None and not naive_ppo(cfg):
        return exp.old_logprobs
    if not compute:
        return None
    logprobs = roles.actor.compute_logprobs(exp)
    if exp.old_logprobs is None:
        exp.old_logprobs = logprobs
    return logprobs


def correct_rollout(roles: Roles, exp: Experience, cfg: RunConfig) -> dict[str, float]:
    """Train / inference mismatch: monitor it, and weight the policy loss when configured.

    rho = pi_trainer / pi_engine of every sampled token (``relayrl.algos.rollout_correction``).
    With ``algo.rollout_correction`` enabled its weights go to ``exp.rollout_weights``,
    which the actor multiplies into the policy loss (of any ``algo.policy_loss``); with
    :func:`needs_behaviour_weight` the behaviour weight f(w) is multiplied in as well. Whenever
    the trainer's logprobs exist anyway the ``rollout_corr/*`` mismatch stats are logged,
    correction or not (mode ``none`` reports them without weighting anything).
    """
    rc = cfg.algo.rollout_correction
    behav = needs_behaviour_weight(cfg)
    trainer = trainer_logprobs(roles, exp, cfg, compute=rc.enabled or behav)
    if trainer is None:
        return {}
    engine = exp.behaviour_logprobs
    assert engine is not None, "the batch has no behaviour logprobs"
    weights, stats = rollout_correction(
        trainer,
        engine,
        exp.response_mask,
        mode=rc.mode,
        level=rc.level,
        cap=rc.cap,
        lower=rc.lower,
        upper=rc.upper,
        batch_normalize=rc.batch_normalize,
        reject_kl=rc.reject_kl,
        kl_estimator=rc.kl_estimator,
        kl_agg=rc.kl_agg,
        mismatch_threshold=rc.mismatch_threshold,
    )
    if rc.enabled:
        exp.rollout_weights = weights.to(torch.float32)
    if behav:
        a = cfg.algo
        factor, w, affected = behaviour_weights(
            trainer, engine, exp.response_mask,
            a.behav_weight_mode, a.behav_weight_cap, a.behav_weight_lower,
        )  # fmt: skip
        prior: Tensor | float = 1.0  # reject_kl's rejections
        if rc.enabled and exp.rollout_weights is not None:
            prior = exp.rollout_weights
        exp.rollout_weights = (factor * prior).to(torch.float32)
        mask = exp.response_mask.bool()
        n = mask.sum().clamp(min=1)
        stats["offpolicy/behav_weight_mean"] = float(w[mask].sum() / n)
        stats["offpolicy/behav_weight_max"] = float(w[mask].max()) if mask.any() else 0.0
        stats["offpolicy/capped_frac"] = float(affected.sum() / n)
    return stats


def correct(
    roles: Roles,
    exp: Experience,
    cfg: RunConfig,
    mismatch: MismatchMonitor | None = None,
    version: int | None = None,
) -> dict[str, float]:
    """Before the update: :func:`correct_rollout`, then, with ``mismatch``, the train /
    inference mismatch of the tokens generated under the trainer's weights (``version``),
    logged (``mismatch/*``, a warning when it jumps) whenever the step has the trainer's
    logprobs before the update (several mini-batches or epochs, ``recompute_old_logprobs:
    always``, a rollout correction); with one update per step, decoupled PPO's included, pi_old
    comes from the update's own forward and there is none to compare (:func:`old_logprobs`)."""
    stats = correct_rollout(roles, exp, cfg)
    if mismatch is not None and exp.old_logprobs is not None and not naive_ppo(cfg):
        assert exp.behaviour_logprobs is not None
        stats.update(
            mismatch.observe(
                exp.behaviour_logprobs,
                exp.old_logprobs,
                exp.response_mask,
                exp.versions,
                version,
                step=version,
            )
        )
    return stats
