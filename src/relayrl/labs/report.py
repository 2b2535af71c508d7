"""The lab's report: ``report.md`` with a results table, per-step PNG plots, the reward-model
figures and the blind-spot probe. Plots need matplotlib (``pip install relayrl[plots]``);
without it the report is written with tables only and says so."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

__all__ = ["write_plots", "write_report"]


CURVES = [
    ("proxy", "reward-model score (normalised)"),
    ("true", "true score"),
    ("kl", "KL(pi || pi_sft) per sequence (nats)"),
    ("grammatical", "grammatical fraction"),
    ("distinct", "distinct responses / batch"),
    ("distinct_2", "distinct-2 (bigram diversity)"),
    ("divergence", "proxy-vs-gold divergence D_t"),
]


def _smooth(values: list[float], k: int = 5) -> list[float]:
    """Trailing moving average over finite values (k steps)."""
    out = []
    for i in range(len(values)):
        window = [v for v in values[max(0, i - k + 1) : i + 1] if math.isfinite(v)]
        out.append(sum(window) / len(window) if window else math.nan)
    return out


def write_plots(out_dir: Path, curves: dict[str, dict[str, list[float]]]) -> list[str]:
    """One PNG per metric, a line per run (5-step moving average); returns file names, or
    an empty list when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    names = []
    for key, label in CURVES:
        if not any(key in c for c in curves.values()):
            continue
        fig, ax = plt.subplots(figsize=(5.5, 3.4), dpi=110)
        for run, c in curves.items():
            if key in c and c[key]:
                ax.plot(c["step"], _smooth(c[key]), label=run)
        ax.set_xlabel("PPO step")
        ax.set_ylabel(label)
        if key == "kl":  # beta = 0 runs end orders of magnitude above beta > 0 ones
            ax.set_yscale("symlog", linthresh=1.0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        name = f"{key}.png"
        fig.savefig(out_dir / name)
        plt.close(fig)
        names.append(name)
    # proxy and true score of each run on one figure: the hacking picture
    fig, ax = plt.subplots(figsize=(6.5, 3.8), dpi=110)
    for run, c in curves.items():
        line = ax.plot(c["step"], _smooth(c["proxy"]), label=f"{run}: RM score")[0]
        ax.plot(
            c["step"], _smooth(c["true"]), "--", color=line.get_color(), label=f"{run}: true score"
        )
    ax.set_xlabel("PPO step")
    ax.set_ylabel("score")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "proxy_vs_true.png")
    plt.close(fig)
    return ["proxy_vs_true.png", *names]


def clean_zero(x: float) -> float:
    """No "-0.00" in tables: |x| < 0.005 prints as 0.00."""
    return 0.0 if abs(x) < 0.005 else x


def _f(x: Any, digits: int = 2) -> str:
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, (int, float)) and math.isfinite(float(x)):
        return f"{float(x):+.{digits}f}" if digits and isinstance(x, float) else str(x)
    return "-"


def write_report(root: Path, results: dict[str, Any], plots: bool = True) -> Path:
    """Write ``root/report.md`` (and PNGs next to it) from the lab's ``results``."""
    pngs = write_plots(root, results.get("curves", {})) if plots else []
    rm, probe, runs = results["rm"], results["blind_spot"], results["runs"]
    t = results.get("timings", {})
    lines = [
        "# RLHF lab: reward hacking against a known true score",
        "",
        "City language: `<city> is a , b and c .` with 1-3 distinct attributes; true score "
        "= #good - #bad words for a grammatical sentence, -3 for anything ungrammatical or "
        "unfinished. Pipeline: tiny word-level Llama -> SFT -> pairs sampled from the SFT "
        "policy with Bradley-Terry labels on the true score -> reward model -> PPO against "
        "the reward model with each beta (KL penalty in the reward) -> fresh-sample "
        "evaluation.",
        "",
        "## Reward model",
        "",
        f"- held-out agreement with the noisy labels: **{rm['label_agreement']:.3f}** "
        f"(noise ceiling E[max(p, 1-p)] = {rm['noise_ceiling']:.3f}; "
        f"{int(rm['pairs'])} pairs)",
        f"- accuracy against the truth on pairs with different true scores: "
        f"**{rm['truth_accuracy']:.3f}** ({int(rm['truth_pairs'])} pairs; chance 0.5)",
        f"- training-pair agreement: {rm['train_accuracy']:.3f}",
        "",
        "### Blind-spot probe: shuffled words",
        "",
        f"{probe['n']} grammatical sentences (2-3 attributes) with their words shuffled: the "
        f"true score drops from {probe['true_original_mean']:+.2f} to "
        f"{probe['true_shuffled_mean']:+.2f} on average, while the reward model scores the "
        f"shuffles {probe['rm_shuffled_mean']:+.2f} against {probe['rm_original_mean']:+.2f} "
        f"for the originals (normalised units). {100 * probe['shuffled_ge_original']:.0f}% of "
        f"shuffles score at least as high as their original; "
        f"{100 * probe['shuffled_above_mean_grammatical']:.0f}% beat the average original; "
        f"correlation original vs shuffle {probe['rm_corr_original_shuffled']:.2f}.",
        "",
        "| original | shuffled | RM original | RM shuffled |",
        "| --- | --- | ---: | ---: |",
        *[
            f"| {e['prompt']} {e['original']} | {e['prompt']} {e['shuffled']} | "
            f"{e['rm_original']:+.2f} | {e['rm_shuffled']:+.2f} |"
            for e in probe["examples"]
        ],
        "",
        "## Policies (fresh samples, temperature 1)",
        "",
        "| policy | RM score | true score | grammatical | finished | KL to SFT | "
        "distinct responses | distinct-2 | length |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, r in runs.items():
        lines.append(
            f"| {name} | {r['proxy']:+.2f} | {r['true']:+.2f} | {r['grammatical']:.2f} | "
            f"{r['finished']:.2f} | {clean_zero(r['kl']):.2f} | "
            f"{r['distinct_responses']}/{r['n']} | {r['distinct_2']:.2f} | {r['length']:.1f} |"
        )
    verdict = results.get("hacking", {})
    if verdict:
        lines += ["", "Checks: " + ", ".join(f"{k} = {_f(v)}" for k, v in verdict.items())]
    lines += ["", "Most frequent completions at the end of each run:", ""]
    for name, r in runs.items():
        tops = "; ".join(f"`{c['completion']}` x{c['count']}" for c in r["top_completions"][:3])
        lines.append(f"- {name}: {tops}")
    if pngs:
        lines += ["", "## Curves (5-step moving average of each step's samples)", ""]
        lines += [f"![{p[:-4]}]({p})" for p in pngs]
    elif plots:
        lines += ["", "(plots skipped: install matplotlib, `pip install 'relayrl[plots]'`)"]
    if t:
        lines += ["", "## Wall time", "", ", ".join(f"{k[:-2]} {v:.0f} s" for k, v in t.items())]
    path = root / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
