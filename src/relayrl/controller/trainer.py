"""The RL run: steps of an algorithm, held-out evals, metrics and checkpoints.

The controller never builds models itself: ``build_roles(actor_path, critic_path)`` comes from
the cluster layer (``local`` today, ``ray`` later), so the same program runs on both.

The run directory is claimed before anything is written into it
(:func:`relayrl.controller.run_dir.claim_run_dir`: a lock for the life of the run; a start
where a run already is, or a resume with nothing left to train, is refused in one line).
A fault ends in one line (:class:`relayrl.controller.faults.RunFault`: what failed, the newest
intact checkpoint); cleaning up after it never replaces it with a second error. SIGINT and
SIGTERM stop the run through :class:`relayrl.controller.faults.RunInterrupted`; with
``train.save_on_signal`` the last *completed* step is checkpointed first (a signal during a
step's weight update is held until the step is logged, see ``StepGuard``).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relayrl.config import RunConfig
from relayrl.controller import preflight
from relayrl.controller.algorithms import make_kl_controller, rollout_stats
from relayrl.controller.background_eval import BackgroundEval
from relayrl.controller.checkpoint import (
    load_role_state,
    load_trainer_state,
    merged_export,
    newest_intact,
    rng_state,
    role_state,
    save_checkpoint,
    seed_everything,
    set_rng_state,
)
from relayrl.controller.eval_replica import EvalReplica
from relayrl.controller.evaluate import eval_progress, held_out_metrics
from relayrl.controller.failures import InfraBudgetExceeded
from relayrl.controller.faults import RunFault, RunInterrupted, StepGuard, signal_name
from relayrl.controller.run_dir import claim_run_dir, record_config
from relayrl.controller.schedules import make_schedule
from relayrl.controller.watchdog import EvalStalled, RolloutStalled, no_mark, run_watched
from relayrl.data.prompt_format import FORMAT_FILE, prompt_format
from relayrl.data.prompts import PromptSource
from relayrl.reward import RewardFunctionError, get_reward_fn, score
from relayrl.telemetry import MetricsLogger, StepProgress, print_summary
from relayrl.telemetry.monitors import RunMonitor
from relayrl.telemetry.summary import summary_scalars
from relayrl.telemetry.timeline import Timeline
from relayrl.telemetry.trackers import TrackerOptions
from relayrl.workers import Roles

RoleBuilder = Callable[[str, str | None], Roles]


def run_monitor(cfg: RunConfig, tokenizer: Any) -> RunMonitor:
    """The run's monitors; ``monitor.gold_fn`` (a reward-function spec, or none) is the gold
    scorer, called through ``relayrl.reward.score`` (a ``{"score": ...}`` dict)."""
    spec = cfg.monitor.gold_fn
    return RunMonitor(tokenizer, functools.partial(score, get_reward_fn(spec)) if spec else None)


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

WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EFBIG}
"""OSErrors that mean the run directory cannot take more writes: a fault, not bad input."""


def train(
    cfg: RunConfig,
    build_roles: RoleBuilder,
    resume: bool = False,
    overwrite: bool = False,
    allow_config_change: bool = False,
) -> dict[str, Any]:
    """Run ``cfg.train.steps`` steps of ``cfg.algo.name``; return the final metrics.

    With ``resume`` the run continues from the newest checkpoint in ``run_dir`` (if any):
    actor and critic weights, optimizer and scheduler state, KL controller and RNG states.
    With ``overwrite`` an earlier run in ``run_dir`` is moved to ``<run_dir>.prev-N`` first;
    without either, a ``run_dir`` that holds a run is refused (``RunDirError``), and so is a
    resume with no run to continue or one that changes the model, algorithm or prompt format
    (unless ``allow_config_change``).
    """
    preflight.check_run(cfg)  # one-line errors before anything is written
    with claim_run_dir(
        cfg.run_dir,
        resume=resume,
        overwrite=overwrite,
        steps=cfg.train.steps,
        cfg=cfg,
        allow_config_change=allow_config_change,
    ) as run:
        for line in run.recovered:  # what a kill or power loss left, completed or cut off
            print(line)
        if run.moved_to is not None:
            why = "no checkpoint to resume from: starting at step 0; " if resume else ""
            print(f"{why}the earlier run in {run.path} was moved to {run.moved_to}")
        for bad, problem, kept in run.corrupt:
            print(
                f"checkpoint {bad} cannot be read ({problem}); kept as {kept.name}, resuming "
                f"from the newest intact checkpoint {run.checkpoint}"
            )
        if run.removed:
            names = ", ".join(p.name for p in run.removed)
            print(f"removed what interrupted writes left in {run.path}: {names}")
        record_config(run.path, cfg)
        if cfg.algo.name == "dpo":  # offline: no roles, no rollouts
            from relayrl.controller.dpo import train_dpo

            return train_dpo(cfg, resume=resume)
        ckpt = run.checkpoint
        actor_path = str(ckpt / "actor") if ckpt else cfg.model.path
        critic_path = (
            str(ckpt / "critic") if ckpt and (ckpt / "critic").is_dir() else cfg.model.critic_path
        )
        seed_everything(cfg.seed)  # a resumed run restores the checkpoint's RNG state below
        roles = build_roles(actor_path, critic_path)
        try:
            result = _run(cfg, roles, ckpt, run.path)
        except InfraBudgetExceeded as exc:  # one line: cause, last error, newest checkpoint
            with contextlib.suppress(Exception):
                roles.close()
            raise RunFault(f"{exc}; {newest_intact(run.path)}") from None
        except OSError as exc:
            with contextlib.suppress(Exception):
                roles.close()
            if exc.errno not in WRITE_ERRNOS and not _inside(exc.filename, run.path):
                raise
            what = f"could not write {exc.filename}" if exc.filename else "a write failed"
            raise RunFault(f"{what} ({exc.strerror}); {newest_intact(run.path)}") from exc
        except BaseException:
            with contextlib.suppress(Exception):  # must not replace the first error
                roles.close()
            raise
        roles.close()
        return result


def _inside(filename: Any, run_dir: Path) -> bool:
    """``filename`` (an OSError's) is in ``run_dir``: any failure there is the run's fault
    (permission, a file removed under it), not the input's."""
    try:
        return bool(filename) and Path(filename).resolve().is_relative_to(run_dir.resolve())
    except (OSError, TypeError, ValueError):
        return False


# Printed when an overlap / async run resumes (docs/first-run.md, "Exactness").
INEXACT_RESUME = (
    "note: a {schedule} run resumes correctly but not bit-identically: the generations in "
    "flight when it stopped are generated again, under other timing and policy versions "
    "(only schedule: sync resumes exactly)"
)


@dataclass
class _Boundary:
    """The state after the last completed step: what a checkpoint of it holds besides the
    weights (which do not change until the next step's update)."""

    step: int
    rng: dict[str, Any]
    schedule: dict[str, Any]
    kl_coef: float
    saved: Path | None  # the checkpoint of this step, once written


def _run(cfg: RunConfig, roles: Roles, ckpt: Path | None, run_dir: Path) -> dict[str, Any]:
    kl_ctl = make_kl_controller(cfg)
    start = 0
    schedule_state: dict[str, Any] = {}
    if ckpt is not None:
        state = load_trainer_state(ckpt)
        start = int(state["step"])
        load_role_state(roles.actor, state["actor"], ckpt)  # sharded (FSDP2) or not
        if roles.critic is not None and "critic" in state:
            load_role_state(roles.critic, state["critic"], ckpt)
        kl_ctl.value = state["kl_coef"]
        set_rng_state(state["rng"])
        schedule_state = state.get("schedule", {})
        print(f"resumed from {ckpt} at step {start}")
        if cfg.schedule != "sync":
            print(INEXACT_RESUME.format(schedule=cfg.schedule))
    if roles.rollout.version != start:
        roles.rollout.update_weights(roles.actor.state_dict(), version=start, interrupt=False)

    tok = roles.tokenizer
    stop_ids = [tok.eos_token_id] if tok.eos_token_id is not None else []
    source = PromptSource(cfg.data, tok, cfg.seed)
    eval_prompts = source.eval_set()
    if source.skipped:
        print(f"skipped {source.skipped} prompts longer than {cfg.data.max_prompt_tokens} tokens")

    def evaluate(engine: Any = None, mark: Callable[[str], None] = no_mark) -> dict[str, float]:
        return held_out_metrics(
            roles.rollout if engine is None else engine,
            roles.reward,
            eval_prompts,
            cfg.rollout.max_tokens,
            stop_ids,
            cfg.eval,
            cfg.reward.fn,
            cfg.failures.retries,
            mark,
        )

    # The stall watchdog watches an evaluation whose engine is its own meanwhile (sync: between
    # steps; a separate replica); the engine async / overlap training shares is not (its
    # counters are training's too, and reading them takes the schedule's busy spans).
    eval_stall_s = cfg.failures.stall_s if cfg.schedule == "sync" else None

    def evaluate_watched(step: int) -> dict[str, float]:
        return run_watched(
            lambda mark: evaluate(mark=mark),
            eval_stall_s,
            eval_progress(roles.rollout, roles.reward),
            what=f"held-out evaluation at step {step}",
            error=EvalStalled,
        )

    # A fresh run starts a fresh metrics file; a resumed one drops records past its checkpoint.
    lg = cfg.logging
    logger = MetricsLogger(
        run_dir,
        resume_step=start if start > 0 else -1,
        backends=lg.active_backends,
        config=cfg.model_dump(mode="json", by_alias=True),
        options=TrackerOptions(lg.project, lg.run_name, lg.wandb_mode, lg.mlflow_tracking_uri),
    )
    final: dict[str, Any] = {}
    stats: dict[str, float] = {}
    monitor = run_monitor(cfg, tok)  # KL, distinct-n, proxy vs gold
    timeline = Timeline()
    schedule = make_schedule(roles, cfg, source, stop_ids, timeline)
    guard = StepGuard(hold=cfg.train.save_on_signal)
    for role in (roles.actor, roles.critic):  # their updates are the part a signal waits for
        if role is not None:
            role.update = guard.wrap(role.update)  # type: ignore[method-assign]
    guard.install()
    beside = cfg.schedule != "sync" and cfg.eval.background and not cfg.env.enabled
    background = None
    if beside and not cfg.env.agent.enabled:
        if cfg.eval.replica == "separate":  # an engine of its own, a snapshot per evaluation
            replica = EvalReplica(cfg, roles)
            background = BackgroundEval(
                lambda mark: evaluate(replica.engine, mark),
                replica.load,
                cfg.failures.stall_s,
                eval_progress(replica.engine, roles.reward),
            )
        else:
            background = BackgroundEval(lambda mark: evaluate(mark=mark))
    boundary = _Boundary(start, rng_state(), {}, kl_ctl.value, ckpt)
    saving = False
    try:
        try:
            first_eval = evaluate_watched(0) if start == 0 else {}
            if first_eval:
                logger.log(0, first_eval)
            final["eval_before"] = first_eval.get("eval/pass_rate")
            schedule.start(start, schedule_state)
            if background is not None and _eval_lost(cfg, start, logger.history):
                print(f"evaluating step {start} again: its record was lost with the stopped run")
                background.start(start)  # the checkpoint's weights, logged when it finished
            with StepProgress(
                cfg.train.steps,
                f"{cfg.algo.name} ({cfg.schedule})",
                enabled=cfg.logging.progress,
                interval_s=cfg.logging.progress_interval_s,
                log_file=run_dir / "progress.log",
                initial=start,  # a resumed run counts on from its checkpoint
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
                    stalled: EvalStalled | None = None  # the step is trained: logged, saved
                    try:
                        if background is not None:  # before a start, which would drop it
                            stats.update(background.collect())
                        if (
                            cfg.train.eval_every
                            and done % cfg.train.eval_every == 0
                            and done < cfg.train.steps
                        ):
                            if background is None:
                                stats.update(evaluate_watched(done))
                            else:  # beside training (docs/failures.md), logged when it finished
                                background.start(done)
                    except EvalStalled as exc:
                        stalled = exc
                    logger.log(done, stats)
                    bar.update(done, reward=stats["reward_mean"], pass_rate=stats["pass_rate"])
                    boundary = _Boundary(done, rng_state(), schedule.state(), kl_ctl.value, None)
                    guard.end_step()  # a signal held during the step's update stops it here
                    if (cfg.train.save_every and done % cfg.train.save_every == 0) or (
                        done == cfg.train.steps
                    ):
                        saving = True
                        boundary.saved = _save(cfg, roles, boundary)
                        saving = False
                    if stalled is not None:  # ends the run, step `done` checkpointed first
                        raise stalled
            if background is not None and (pending := background.collect(wait=True)):
                logger.log(cfg.train.steps, pending)
            last_eval = evaluate_watched(cfg.train.steps)
            logger.log(cfg.train.steps, last_eval)
        except KeyboardInterrupt as exc:
            raise _stopped(exc, cfg, roles, boundary, guard, saving, run_dir) from exc
        except (RewardFunctionError, InfraBudgetExceeded, RolloutStalled) as exc:  # before the
            if guard.pending is not None or saving:  # update: the last completed step is saved
                raise
            raise _reward_failed(exc, cfg, roles, boundary, guard, run_dir) from exc
        except Exception as exc:
            if guard.pending is None:
                raise
            # a signal was held and the step then failed (e.g. the engine worker, signalled
            # too, died): the step is abandoned, its weights are not saved
            name, step_no = signal_name(guard.pending), boundary.step + 1
            msg = f"stopped by {name} during step {step_no} ({exc}); {newest_intact(run_dir)}"
            raise RunInterrupted(guard.pending, msg) from exc
        finally:
            guard.restore()
    except BaseException:
        _close_quietly(schedule, timeline, logger, run_dir)
        raise
    final.update(schedule.close())
    timeline.write(run_dir / "timeline.json")
    summary = summary_scalars(logger.history, SUMMARY_KEYS)
    summary.update({k: v for k in ("eval_before",) if (v := final.get(k)) is not None})
    summary["eval_after"] = last_eval["eval/pass_rate"]
    logger.log_summary(summary)
    logger.close()
    print_summary(logger.history, SUMMARY_KEYS, f"{cfg.algo.name} on {cfg.model.path}")
    final.update(stats)
    final["eval_after"] = last_eval["eval/pass_rate"]
    return final


def _eval_lost(cfg: RunConfig, start: int, history: list[dict[str, Any]]) -> bool:
    """Whether the background evaluation of the checkpointed step ``start`` was due
    (``train.eval_every``, before the last step) and its record is not in ``history`` (the
    records up to ``start``): it was still running, or finished after ``start``, when the run
    stopped, and the resume dropped the later record that would have held it."""
    every = cfg.train.eval_every
    if not every or start <= 0 or start % every or start >= cfg.train.steps:
        return False
    return not any(r.get("eval/at_step") == start for r in history)


def _close_quietly(schedule: Any, timeline: Timeline, logger: MetricsLogger, run_dir: Path) -> None:
    """Clean up after a failed or stopped run: a second failure here (the disk that failed the
    checkpoint also fails the timeline) must not replace the first error."""
    with contextlib.suppress(Exception):
        schedule.close()
    with contextlib.suppress(Exception):
        timeline.write(run_dir / "timeline.json")
    with contextlib.suppress(Exception):
        logger.close(failed=True)


def _stopped(
    exc: KeyboardInterrupt,
    cfg: RunConfig,
    roles: Roles,
    b: _Boundary,
    guard: StepGuard,
    saving: bool,
    run_dir: Path,
) -> RunInterrupted:
    """Checkpoint the last completed step when allowed; the one line that says what happened."""
    signum = getattr(exc, "signum", signal.SIGINT)
    name = signal_name(signum)
    if saving:
        what = f"stopped by {name} while writing checkpoint step_{b.step:06d}"
    elif not guard.clean:
        what = f"stopped by {name} during step {b.step + 1} (a second signal abandoned it)"
    elif b.step == 0:
        what = f"stopped by {name} during step 1"
    elif b.saved is not None and b.saved.name == f"step_{b.step:06d}":
        what = f"stopped by {name} after step {b.step}"
    elif not cfg.train.save_on_signal:
        what = f"stopped by {name} after step {b.step} (train.save_on_signal is off)"
    else:
        what = f"stopped by {name} after step {b.step}"
        try:
            b.saved = _save(cfg, roles, b)
            return RunInterrupted(
                signum, f"{what}; checkpoint {b.saved} written; continue with --resume"
            )
        except RunFault as fault:
            return RunInterrupted(signum, f"{what}; {fault}")
        except KeyboardInterrupt:
            what += f" (a second signal stopped the write of checkpoint step_{b.step:06d})"
    newest = newest_intact(run_dir)
    tail = "; continue with --resume" if newest.startswith("the newest") else ""
    return RunInterrupted(signum, f"{what}; {newest}{tail}")


def _reward_failed(
    exc: RewardFunctionError | InfraBudgetExceeded | RolloutStalled,
    cfg: RunConfig,
    roles: Roles,
    b: _Boundary,
    guard: StepGuard,
    run_dir: Path,
) -> RunFault:
    """A reward function raised, infrastructure failures exhausted their budget (a reward
    function that raises or hangs on every sample), the rollout stalled (the weights are still
    the last completed step's: scoring comes before the update) or a held-out evaluation
    stalled (after its step was logged: that step is the last completed one): checkpoint the
    last completed step as a signal does; the one line."""
    what = str(exc) if isinstance(exc, EvalStalled) else f"{exc} (step {b.step + 1})"
    done = b.saved is not None and b.saved.name == f"step_{b.step:06d}"
    if not (done or guard.committing or b.step == 0 or not cfg.train.save_on_signal):
        try:
            b.saved = _save(cfg, roles, b)
            return RunFault(f"{what}; checkpoint {b.saved} written; continue with --resume")
        except RunFault as fault:
            return RunFault(f"{what}; {fault}")
    newest = newest_intact(run_dir)
    more = b.step < cfg.train.steps  # the final evaluation's stall leaves nothing to train
    tail = "; continue with --resume" if newest.startswith("the newest") and more else ""
    return RunFault(f"{what}; {newest}{tail}")


def _rates(exp: Any, stats: dict[str, float], cfg: RunConfig) -> dict[str, float]:
    resp_tokens = float(exp.response_mask.sum())
    all_tokens = float(exp.batch.attention_mask.sum())
    out = {"train_tokens_per_s": all_tokens * cfg.algo.epochs / max(stats["time/train"], 1e-9)}
    if "time/generate" in stats:  # sync: the step's own generation; async: engine-reported
        out["gen_tokens_per_s"] = resp_tokens / max(stats["time/generate"], 1e-9)
    return out


def _save(cfg: RunConfig, roles: Roles, b: _Boundary) -> Path:
    models: dict[str, Any] = {"actor": roles.actor.model}
    state: dict[str, Any] = {"kl_coef": b.kl_coef, "schedule": b.schedule}
    writers = []  # sharded (FSDP2) roles: every rank writes its shards
    for name, role in (("actor", roles.actor), ("critic", roles.critic)):
        if role is None:
            continue
        models[name] = role.model
        state[name], writer = role_state(role, name)
        if writer is not None:
            writers.append(writer)
    src = cfg.data.source  # the actor's prompt format, for eval / serve of the checkpoint
    fmt = json.dumps(prompt_format(roles.tokenizer, src.chat_template, src.system_prompt))

    def write_format(ckpt: Path) -> None:
        (ckpt / "actor" / FORMAT_FILE).write_text(fmt + "\n")

    writers.append(write_format)
    if cfg.model.lora is not None and cfg.model.lora.save_merged:
        writers.append(merged_export(roles.actor.model, roles.tokenizer))
    return save_checkpoint(
        cfg.run_dir,
        b.step,
        models,
        roles.tokenizer,
        state,
        cfg.train.keep_checkpoints,
        b.rng,
        writers,
    )
