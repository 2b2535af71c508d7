"""``relayrl demo``: build a tiny model, warm-start it with SFT, then GRPO on arithmetic.

Prints the greedy pass rate on held-out problems before and after RL. The tiny model is saved
with ``save_pretrained`` and loaded through the same path as a user's model.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TypedDict

from relayrl.cluster.local import build_local_roles
from relayrl.config import ArithmeticConfig, RunConfig, SFTConfig, load_config
from relayrl.controller.sft import run_sft
from relayrl.controller.trainer import train
from relayrl.data.prompts import PromptSource
from relayrl.model import build_tiny_model, load_tokenizer
from relayrl.model.tiny import Arch

DEMO_ARITHMETIC = dict(min_operand=0, max_operand=99, operators=["+"], num_operands=2)


class TinySizes(TypedDict):
    """``build_tiny_model``'s architecture and sizes."""

    arch: Arch
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int


TINY = TinySizes(arch="llama", hidden_size=96, num_layers=2, num_heads=4, num_kv_heads=2)


def demo_configs(run_dir: Path, overrides: list[str] | None = None) -> tuple[SFTConfig, RunConfig]:
    sft = SFTConfig(
        model_path=str(run_dir / "base"),
        output_dir=str(run_dir / "sft"),
        arithmetic=ArithmeticConfig(**DEMO_ARITHMETIC),
        eval_every=25,
        target_pass_rate=0.3,
    )
    rl = load_config(
        RunConfig,
        None,
        [
            f"run_dir={run_dir / 'grpo'}",
            f"model.path={run_dir / 'sft'}",
            *[f"data.arithmetic.{k}={v}" for k, v in DEMO_ARITHMETIC.items()],
            *(overrides or []),
        ],
    )
    return sft, rl


def run_demo(run_dir: Path, overrides: list[str] | None = None) -> dict[str, float]:
    t0 = time.perf_counter()
    sft_cfg, rl_cfg = demo_configs(run_dir, overrides)
    base = Path(sft_cfg.model_path)
    if not (base / "config.json").is_file():
        build_tiny_model(base, **TINY, seed=rl_cfg.seed)
        print(f"built tiny model at {base}")
    held_out = {
        p.record.prompt
        for p in PromptSource(rl_cfg.data, load_tokenizer(base), rl_cfg.seed).eval_set()
    }
    print("SFT warm start ...")
    sft_out = run_sft(sft_cfg, exclude_prompts=held_out)
    print(
        f"SFT stopped after {int(sft_out['sft/steps'])} steps at validation pass rate "
        f"{100 * sft_out.get('sft/val_pass_rate', float('nan')):.1f}%"
    )
    t_sft = time.perf_counter()
    print("GRPO ...")
    # a demo is re-run as a whole: an earlier demo's GRPO run is moved aside, never deleted
    out = train(rl_cfg, lambda a, c: build_local_roles(rl_cfg, a, c), overwrite=True)
    t_rl = time.perf_counter()
    before, after = out["eval_before"], out["eval_after"]
    print(
        f"\nheld-out greedy pass rate ({rl_cfg.data.eval_size} problems): "
        f"after SFT {100 * before:.1f}%  ->  after GRPO {100 * after:.1f}%  "
        f"(+{100 * (after - before):.1f} points)"
    )
    print(f"time: SFT {t_sft - t0:.0f} s, GRPO {t_rl - t_sft:.0f} s")
    return {"before": before, "after": after}
