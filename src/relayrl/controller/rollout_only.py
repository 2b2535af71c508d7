"""``relayrl train CONFIG --rollout-only``: generation, environments and scoring without training.

What a user debugging a reward function or an environment runs first (SkyRL's and slime's
``--debug-rollout-only``): ``train.steps`` steps of the sync schedule's rollout (the same
requests, seeds, retries of infrastructure failures, regenerated groups, failure tagging and
stall watchdog as training), no update, no checkpoint, nothing written to ``run_dir``. Prints
one line per step (time split, reward, pass rate, infrastructure failures by cause), then a
few samples with their scores and failure tags. A budget that a real run would stop at stops
this one the same way.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from functools import partial
from typing import Any

from torch import Tensor

from relayrl.config import RunConfig
from relayrl.controller.algorithms import make_requests, rollout_and_score, rollout_progress
from relayrl.controller.dynamic_sampling import regenerate_small_groups
from relayrl.controller.failures import FailureLog
from relayrl.controller.schedules import attach_episodes
from relayrl.controller.watchdog import run_watched
from relayrl.data.prompts import PromptSource
from relayrl.rollout import Sample
from relayrl.workers import Roles

RoleBuilder = Callable[[str, str | None], Roles]


def rollout_only(
    cfg: RunConfig,
    build_roles: RoleBuilder,
    show: int = 3,
    out: Callable[[str], Any] = print,
) -> dict[str, float]:
    """Run the rollout of ``cfg.train.steps`` steps; return the totals (see module)."""
    roles = attach_episodes(build_roles(cfg.model.path, cfg.model.critic_path), cfg)
    try:
        return _run(cfg, roles, show, out)
    finally:
        roles.close()


def _rollout(
    roles: Roles,
    cfg: RunConfig,
    source: PromptSource,
    log: FailureLog,
    step: int,
    stop_ids: list[int],
    timer: dict[str, float],
    mark: Callable[[str], None],
) -> tuple[list[Sample], Tensor]:
    """The sync schedule's rollout of ``step``: generated, scored, retried, small groups
    regenerated (``SyncSchedule.rollout`` without dynamic sampling)."""
    requests = make_requests(source.for_step(step, cfg.algo.prompts_per_step), cfg, step, stop_ids)
    samples, scores, _ = rollout_and_score(roles, requests, timer, cfg.failures.retries, mark)
    if cfg.algo.name != "ppo":
        samples, scores, n = regenerate_small_groups(
            roles, cfg, step, stop_ids, samples, scores, source, timer, mark
        )
        log.count_regenerated(n)
    return samples, scores


def _run(cfg: RunConfig, roles: Roles, show: int, out: Callable[[str], Any]) -> dict[str, float]:
    tok = roles.tokenizer
    stop_ids = [tok.eos_token_id] if tok.eos_token_id is not None else []
    source = PromptSource(cfg.data, tok, cfg.seed)
    log = FailureLog(cfg.failures)
    totals: defaultdict[str, float] = defaultdict(float)
    shown: list[tuple[Sample, float]] = []
    for step in range(cfg.train.steps):
        timer: dict[str, float] = {}
        samples, scores = run_watched(
            partial(_rollout, roles, cfg, source, log, step, stop_ids, timer),
            cfg.failures.stall_s,
            partial(rollout_progress, roles),
        )
        kept, kept_scores = log.admit(samples, scores, grouped=cfg.algo.name != "ppo")
        m = log.metrics()
        outcomes = roles.reward.outcomes(kept, kept_scores)
        causes = ", ".join(
            f"{k.removeprefix('failures/infra/')} {v:.0f}"
            for k, v in sorted(m.items())
            if k.startswith("failures/infra/") and v
        )
        out(
            f"step {step + 1}: generate {timer['time/generate']:.2f} s, "
            f"score {timer['time/score']:.2f} s, {len(samples)} samples, "
            f"{len(kept)} would train, reward mean {float(kept_scores.mean()):.3f}, "
            f"pass rate {float((outcomes >= 1.0).float().mean()):.3f}, "
            f"retried {timer.get('failures/retried', 0.0):.0f}, "
            f"infra failures {m['failures/infra']:.0f}" + (f" ({causes})" if causes else "")
        )
        totals["samples"] += len(samples)
        totals["trained"] += len(kept)
        totals["failures/infra"] += int(m["failures/infra"])
        totals["failures/retried"] += int(timer.get("failures/retried", 0.0))
        totals["time/generate"] += timer["time/generate"]
        totals["time/score"] += timer["time/score"]
        for k, v in m.items():
            if k.startswith("failures/infra/"):
                totals[k] += v
        if len(shown) < show:
            shown.extend(zip(samples[: show - len(shown)], scores.tolist(), strict=False))
    for sample, value in shown:
        prompt = str(sample.metadata.get("prompt", "")).replace("\n", " ")[:80]
        text = tok.decode(sample.response_ids, skip_special_tokens=True).replace("\n", " ")
        failure = sample.metadata.get("failure")
        tag = f" [{failure['kind']} failure: {failure['cause']}]" if failure else ""
        out(f"  {prompt!r} -> {text[:120]!r}: score {value:g}{tag}")
    return dict(totals)
