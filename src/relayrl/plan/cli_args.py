"""Options of the planner subcommands (handlers in :mod:`relayrl.plan.cli`).

Every option's help names its unit; ``--help`` shows the defaults
(``ArgumentDefaultsHelpFormatter``).
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["register"]


class _FMT(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` unless the help already says its default, or there is none
    (``None``, a flag's ``False``)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.default in (None, False):
            return text
        return super()._get_help_string(action)


def _common_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="qwen2.5-1.5b", help="preset name or local HF model dir")
    p.add_argument(
        "--hardware",
        default="h100",
        help="a100 | h100 | h200 | h800 | h200-measured (relayrl's own H200 figures)",
    )
    p.add_argument(
        "--mfu",
        type=float,
        default=None,
        help="model FLOPs utilisation (0..1] (default 0.4; h200-measured: the measured one)",
    )
    p.add_argument(
        "--decode-eff",
        type=float,
        default=None,
        help="share of HBM bandwidth in decode (0..1] (default 0.6; h200-measured: measured)",
    )


def _json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="one JSON object per row")


def _simulate(sub: Any) -> argparse.ArgumentParser:
    s = sub.add_parser(
        "simulate", help="simulate sync / overlap / async schedules", formatter_class=_FMT
    )
    _common_model(s)
    s.add_argument("--profile", help="measured profile JSON (instead of --model/--hardware)")
    s.add_argument("--schedule", default="sync,overlap,async", help="comma list")
    s.add_argument("--eta", default="0,1,2,4,inf", help="comma list for async ('inf' = unbounded)")
    s.add_argument("--no-interrupt", action="store_true", help="async: do not interrupt on updates")
    s.add_argument(
        "--finish-order",
        action="store_true",
        help="async: train the oldest finished samples (async.in_order: false)",
    )
    s.add_argument("--devices", type=int, default=16, help="GPUs in all")
    s.add_argument(
        "--train-devices",
        default=None,
        help="overlap/async training GPUs, comma list to sweep (default: a quarter)",
    )
    s.add_argument("--tp", type=int, default=1, help="GPUs per generation replica")
    s.add_argument("--batch", type=int, default=512, help="samples per training step")
    s.add_argument("--steps", type=int, default=8, help="training steps to simulate")
    s.add_argument("--prompt-len", type=int, default=256, help="prompt tokens per sample")
    s.add_argument(
        "--lengths",
        default="lognormal:2000:0.8:16384",
        help="response tokens: lognormal:MEDIAN:SIGMA:CAP | constant:N | fixed:N,N | "
        "empirical:PATH",
    )
    s.add_argument(
        "--slots", type=int, default=None, help="sequences per replica (default: KV limit)"
    )
    s.add_argument(
        "--weight-sync-s",
        type=float,
        default=None,
        help="seconds per weight update (default: weights / --sync-bandwidth when split)",
    )
    s.add_argument("--sync-bandwidth", type=float, default=25.0, help="trainer->generator GB/s")
    s.add_argument(
        "--turns",
        default="1",
        help="turns per episode: N, or a length spec for a distribution (agent workloads)",
    )
    s.add_argument(
        "--env-latency",
        default=None,
        help="environment wait after each turn but the last, seconds: lognormal:MEDIAN:P99"
        "[:CAP] | constant:S | samples:S,S,... | fixed:S,S,... | file:PATH",
    )
    s.add_argument(
        "--obs-tokens", type=int, default=0, help="observation tokens per environment step"
    )
    s.add_argument(
        "--resume-prefill",
        choices=("context", "observation"),
        default="context",
        help="on return: prefill the whole context (KV evicted) or only the observation",
    )
    s.add_argument(
        "--independent-turns",
        action="store_true",
        help="sync/overlap: an episode goes on when its own environment returns (default: "
        "turns in lock-step, the batch waits for its slowest environment call)",
    )
    s.add_argument("--seed", type=int, default=0, help="seeds lengths, turns and waits")
    s.add_argument("--plot", help="directory for utilisation/staleness PNGs and Chrome traces")
    _json(s)
    return s


def _reshard(sub: Any) -> argparse.ArgumentParser:
    r = sub.add_parser(
        "reshard", help="train -> generate resharding: per-GPU intervals", formatter_class=_FMT
    )
    r.add_argument("--train", required=True, help="p-t-d, e.g. 1-8-1 (at most 4096 GPUs)")
    r.add_argument("--gen", required=True, help="p_g-t_g, e.g. 1-2")
    r.add_argument("--model", help="preset or HF dir (size in bf16)")
    r.add_argument("--model-gb", type=float, help="model size M in GB (e.g. 140 for 70B bf16)")
    r.add_argument("--bandwidth", type=float, help="GB/s per GPU (separate: trainer->generator)")
    r.add_argument(
        "--strategy", default="all", help="hybridflow,hybridflow-v,deepspeed-chat,separate"
    )
    r.add_argument("--per-gpu", action="store_true", help="print every GPU's intervals")
    _json(r)
    return r


def _roles(p: argparse.ArgumentParser) -> None:
    for role in ("actor", "critic", "ref", "reward"):
        p.add_argument(f"--{role}", help=f"{role} model (default --model)")


def _placement(sub: Any) -> argparse.ArgumentParser:
    pl = sub.add_parser(
        "placement",
        help="rank the 15 placements of actor/critic/ref/reward",
        formatter_class=_FMT,
    )
    _common_model(pl)
    _roles(pl)
    pl.add_argument("--devices", default="16", help="GPU count(s), comma list")
    pl.add_argument("--batch", type=int, default=1024, help="responses per iteration")
    pl.add_argument("--prompt-len", type=int, default=256, help="prompt tokens")
    pl.add_argument("--mean-len", type=int, default=1024, help="mean response tokens")
    pl.add_argument(
        "--max-len", type=int, default=None, help="longest response, tokens (default: no tail)"
    )
    pl.add_argument(
        "--lengths",
        default=None,
        help="response-length distribution as in simulate (overrides --mean-len/--max-len)",
    )
    pl.add_argument(
        "--gen-per-device", type=int, default=64, help="sequences decoded at once per GPU"
    )
    pl.add_argument("--top", type=int, default=15, help="rows to show (>= 1)")
    _json(pl)
    return pl


def _plan(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "plan", help="ReaLHF-style execution-plan search (MCMC)", formatter_class=_FMT
    )
    _common_model(p)
    _roles(p)
    p.add_argument("--nodes", type=int, default=2, help="nodes of the hardware's GPUs per node")
    p.add_argument("--batch", type=int, default=512, help="responses per iteration")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens")
    p.add_argument("--gen-len", type=int, default=896, help="response tokens")
    p.add_argument("--steps", type=int, default=4000, help="annealing steps")
    p.add_argument("--seed", type=int, default=0, help="annealing seed")
    p.add_argument("--trace", help="write the best plan's timeline as a Chrome trace (path)")
    _json(p)
    p.set_defaults(model="7b", hardware="a100")
    return p


def _cost(sub: Any) -> argparse.ArgumentParser:
    c = sub.add_parser("cost", help="GPU-hours, money, memory, one RL step", formatter_class=_FMT)
    _common_model(c)
    c.add_argument("--tokens", type=float, default=0.0, help="training tokens (SFT-style estimate)")
    c.add_argument("--gpus", type=int, default=8, help="GPUs, for the wall-clock days column")
    c.add_argument(
        "--price", type=float, default=None, help="money per GPU-hour (default: the hardware's)"
    )
    c.add_argument("--rl", action="store_true", help="also cost one RL step")
    c.add_argument("--prompts", type=int, default=512, help="prompts per RL step")
    c.add_argument("--samples", type=int, default=8, help="samples per prompt")
    c.add_argument("--prompt-len", type=int, default=512, help="prompt tokens")
    c.add_argument("--response-len", type=int, default=2048, help="response tokens")
    c.add_argument("--tail-factor", type=float, default=1.0, help="longest / mean generation time")
    c.add_argument("--no-ref", action="store_true", help="no reference model")
    c.add_argument("--critic", action="store_true", help="PPO: add a critic like the actor")
    c.add_argument("--reward-model", help="reward model preset (default: rule-based verifier)")
    c.add_argument("--rl-steps", type=int, default=1000, help="RL steps for the run total")
    _json(c)
    c.set_defaults(model="7b")
    return c


def _profile(sub: Any) -> argparse.ArgumentParser:
    pr = sub.add_parser(
        "profile",
        help="measure decode/prefill/train speed of a local model",
        formatter_class=_FMT,
    )
    pr.add_argument("model_dir", help="local HF model directory")
    pr.add_argument("--out", default="profile.json", help="profile JSON to write")
    pr.add_argument("--batches", default="1,4,16,64,256", help="decode batch sizes to time")
    pr.add_argument("--context", type=int, default=64, help="cached tokens per sequence")
    pr.add_argument("--decode-steps", type=int, default=8, help="decode steps timed per batch")
    pr.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    pr.add_argument(
        "--also-threads",
        default="",
        help="measure again at these thread counts, e.g. 2 (used by the time model as measured)",
    )
    _json(pr)
    return pr


def register(sub: Any) -> dict[str, argparse.ArgumentParser]:
    """Add the six planner subparsers to ``sub``; returns them by name."""
    return {
        "simulate": _simulate(sub),
        "reshard": _reshard(sub),
        "placement": _placement(sub),
        "plan": _plan(sub),
        "cost": _cost(sub),
        "profile": _profile(sub),
    }
