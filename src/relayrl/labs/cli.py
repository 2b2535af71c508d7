"""The RLHF subcommands: ``relayrl rm CONFIG`` and ``relayrl dpo CONFIG`` (and the lab entry
``relayrl demo rlhf``, dispatched from the ``demo`` subcommand)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

__all__ = ["add_subcommands", "cmd_demo_rlhf", "cmd_dpo", "cmd_rm"]


def cmd_rm(args: argparse.Namespace) -> int:
    """Train a reward model; print held-out pairwise accuracy and where it was saved."""
    from relayrl.config import load_config
    from relayrl.controller.rm_training import RMConfig, train_reward_model
    from relayrl.model import check_model_dir

    cfg = load_config(RMConfig, args.config, args.overrides)
    check_model_dir(cfg.model_path)
    out = train_reward_model(cfg)
    skipped = sum(out["skipped"].values())
    print(
        f"saved {cfg.output_dir} (AutoModelForSequenceClassification, 1 label): held-out "
        f"pairwise accuracy {100 * out['eval_accuracy']:.1f}% on {out['eval_pairs']} pairs, "
        f"trained on {out['train_pairs']} pairs" + (f", {skipped} rows skipped" if skipped else "")
    )
    return 0


def cmd_dpo(args: argparse.Namespace) -> int:
    """Offline DPO from a run config (``algo.name`` is set to ``dpo``)."""
    from relayrl.config import RunConfig, load_config
    from relayrl.controller.trainer import train
    from relayrl.model import check_model_dir

    cfg = load_config(RunConfig, args.config, ["algo.name=dpo", *args.overrides])
    check_model_dir(cfg.model.path)

    def no_roles(actor: str, critic: str | None) -> Any:
        raise AssertionError("offline DPO builds no rollout roles")

    # through the trainer: the run directory is claimed (lock, refusal, --overwrite) as for RL
    out = train(cfg, no_roles, resume=args.resume, overwrite=args.overwrite)
    before, after = out.get("eval_before"), out.get("eval_after")
    if before is not None and after is not None:
        print(
            f"held-out preference accuracy (implicit reward): before {100 * before:.1f}%  "
            f"after {100 * after:.1f}%"
        )
    return 0


def cmd_demo_rlhf(run_dir: str | Path, overrides: list[str]) -> int:
    """``relayrl demo rlhf [key=value ...]``: the reward-hacking lab under ``run_dir``."""
    from relayrl.labs.lab import main_lab

    main_lab(run_dir, overrides)
    return 0


def add_subcommands(sub: Any) -> None:
    """Register ``rm`` and ``dpo`` on the main parser's subparsers."""
    r = sub.add_parser("rm", help="train a reward model on preference pairs (Bradley-Terry)")
    r.add_argument(
        "config", help="YAML reward-model config (relayrl.controller.rm_training.RMConfig)"
    )
    r.add_argument("overrides", nargs="*", help="key=value overrides, e.g. lr=5e-4")
    r.set_defaults(fn=cmd_rm)

    d = sub.add_parser("dpo", help="offline DPO on preference pairs from a YAML run config")
    d.add_argument("config", help="YAML run config (data.train_path: preference pairs)")
    d.add_argument("overrides", nargs="*", help="key=value overrides, e.g. algo.kl_coef=0.1")
    d.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    d.add_argument(
        "--overwrite", action="store_true", help="move an earlier run in run_dir aside first"
    )
    d.set_defaults(fn=cmd_dpo)
