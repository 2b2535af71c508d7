"""The synchronous RL run: steps of an algorithm, held-out evals, metrics and checkpoints.

The controller never builds models itself: ``build_roles(actor_path, critic_path)`` comes from
the cluster layer (``local`` today, ``ray`` later), so the same program runs on both.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from relayrl.config import RunConfig, dump_config
from relayrl.controller import preflight
from relayrl.controller.algorithms import make_kl_controller, rollout_stats
from relayrl.controller.checkpoint import (
    latest_checkpoint,
    load_trainer_state,
    save_checkpoint,
    seed_everything,
    set_rng_state,
)
from relayrl.controller.evaluate import greedy_pass_rate
from relayrl.controller.prompts import PromptSource
from relayrl.controller.schedules import make_schedule
from relayrl.rlhf.monitors import RunMonitor
from relayrl.telemetry import MetricsLogger, StepProgress, print_summary
from relayrl.telemetry.timeline import Timeline
from relayrl.workers import Roles

RoleBuilder = Callable[[str, str | None], Roles]

SUMMARY_KEYS = [
    "reward_mean",
    "pass_rate",
    "kl",
    "entropy",
    "clipfrac",
    "response_length_mean",
    "gen_tokens_per_s",
    "train_tokens_per_s",
]


def train(cfg: RunConfig, build_roles: RoleBuilder, resume: bool = False) -> dict[str, Any]:
    """Run ``cfg.train.steps`` steps of ``cfg.algo.name``; return the final metrics.

    With ``resume`` the run continues from the newest checkpoint in ``run_dir`` (if any):
    actor and critic weights, optimizer and scheduler state, KL controller and RNG states.
    """
    preflight.check_run(cfg)  # one-line errors before anything is written
    if cfg.algo.name == "dpo":  # offline: no roles, no rollouts
        from relayrl.rlhf.dpo import train_dpo

        return train_dpo(cfg, resume=resume)
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    dump_config(cfg, run_dir / "config.yaml")

    ckpt = latest_checkpoint(run_dir) if resume else None
    actor_path = str(ckpt / "actor") if ckpt else cfg.model.path
    critic_path = (
        str(ckpt / "critic") if ckpt and (ckpt / "critic").is_dir() else cfg.model.critic_path
    )
    seed_everything(cfg.seed)  # a resumed run restores the checkpoint's RNG state below
    roles = build_roles(actor_path, critic_path)
    try:
        return _run(cfg, roles, ckpt, run_dir)
    finally:
        roles.close()


def _run(cfg: RunConfig, roles: Roles, ckpt: Path | None, run_dir: Path) -> dict[str, Any]:
    kl_ctl = make_kl_controller(cfg)
    start = 0
    schedule_state: dict[str, Any] = {}
    if ckpt is not None:
        state = load_trainer_state(ckpt)
        start = int(state["step"])
        roles.actor.load_train_state(state["actor"])
        if roles.critic is not None and "critic" in state:
            roles.critic.load_train_state(state["critic"])
        kl_ctl.value = state["kl_coef"]
        set_rng_state(state["rng"])
        schedule_state = state.get("schedule", {})
        print(f"resumed from {ckpt} at step {start}")
    if roles.rollout.version != start:
        roles.rollout.update_weights(roles.actor.state_dict(), version=start, interrupt=False)

    tok = roles.tokenizer
    stop_ids = [tok.eos_token_id] if tok.eos_token_id is not None else []
    source = PromptSource(cfg.data, tok, cfg.seed)
    eval_prompts = source.eval_set()
    if source.skipped:
        print(f"skipped {source.skipped} prompts longer than {cfg.data.max_prompt_tokens} tokens")

    def evaluate() -> dict[str, float]:
        return greedy_pass_rate(
            roles.rollout, roles.reward, eval_prompts, cfg.rollout.max_tokens, stop_ids
        )

    # A fresh run starts a fresh metrics file; a resumed one drops records past its checkpoint.
    logger = MetricsLogger(
        run_dir, tensorboard=cfg.logging.tensorboard, resume_step=start if start > 0 else -1
    )
    first_eval = evaluate() if start == 0 else {}
    if first_eval:
        logger.log(0, first_eval)
    final: dict[str, Any] = {"eval_before": first_eval.get("eval/pass_rate")}
    stats: dict[str, float] = {}
    monitor = RunMonitor.from_config(cfg, tok)  # KL, distinct-n, proxy vs gold
    timeline = Timeline()
    schedule = make_schedule(roles, cfg, source, stop_ids, timeline)
    schedule.start(start, schedule_state)
    try:
        with StepProgress(
            cfg.train.steps - start,
            f"{cfg.algo.name} ({cfg.schedule})",
            enabled=cfg.logging.progress,
        ) as bar:
            for step in range(start, cfg.train.steps):
                t0 = time.perf_counter()
                exp, stats = schedule.step(step, kl_ctl)
                stats.update(rollout_stats(exp))
                stats.update(_rates(exp, stats, cfg))
                stats.update(monitor(exp))
                stats["time/step"] = time.perf_counter() - t0
                stats["kl"] = stats.get("actor/kl", stats.get("kl_in_reward", 0.0))
                stats["entropy"] = stats.get("actor/entropy", 0.0)
                stats["clipfrac"] = stats.get("actor/clipfrac", 0.0)
                done = step + 1
                if (
                    cfg.train.eval_every
                    and done % cfg.train.eval_every == 0
                    and done < cfg.train.steps
                ):
                    stats.update(evaluate())
                logger.log(done, stats)
                bar.update(done - start, reward=stats["reward_mean"], pass_rate=stats["pass_rate"])
                if (cfg.train.save_every and done % cfg.train.save_every == 0) or (
                    done == cfg.train.steps
                ):
                    _save(cfg, roles, done, kl_ctl.value, schedule.state())
    finally:
        final.update(schedule.close())
        timeline.write(run_dir / "timeline.json")
    last_eval = evaluate()
    logger.log(cfg.train.steps, last_eval)
    logger.close()
    print_summary(logger.history, SUMMARY_KEYS, f"{cfg.algo.name} on {cfg.model.path}")
    final.update(stats)
    final["eval_after"] = last_eval["eval/pass_rate"]
    return final


def _rates(exp: Any, stats: dict[str, float], cfg: RunConfig) -> dict[str, float]:
    resp_tokens = float(exp.response_mask.sum())
    all_tokens = float(exp.batch.attention_mask.sum())
    out = {"train_tokens_per_s": all_tokens * cfg.algo.epochs / max(stats["time/train"], 1e-9)}
    if "time/generate" in stats:  # sync: the step's own generation; async: engine-reported
        out["gen_tokens_per_s"] = resp_tokens / max(stats["time/generate"], 1e-9)
    return out


def _save(
    cfg: RunConfig, roles: Roles, step: int, kl_coef: float, schedule: dict[str, Any]
) -> Path:
    models: dict[str, Any] = {"actor": roles.actor.model}
    state: dict[str, Any] = {
        "actor": roles.actor.train_state(),
        "kl_coef": kl_coef,
        "schedule": schedule,
    }
    if roles.critic is not None:
        models["critic"] = roles.critic.model
        state["critic"] = roles.critic.train_state()
    return save_checkpoint(
        cfg.run_dir, step, models, roles.tokenizer, state, cfg.train.keep_checkpoints
    )
