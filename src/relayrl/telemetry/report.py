"""``relayrl report RUN_DIR [RUN_DIR ...]``: a markdown report with PNG plots of one or more
runs, every run on the same axes.

Reads what the trainer writes into a run directory: ``metrics.jsonl`` (one record per step,
``relayrl.telemetry.metrics``), ``timeline.json`` (Chrome-trace spans per role,
``relayrl.telemetry.timeline``) and ``config.yaml``. Plots (``relayrl.telemetry.plots``):
reward, pass rate (training samples and the held-out eval), KL, entropy, response length,
clip fraction, throughput, staleness and engine / trainer utilisation (runs whose schedule
is not ``sync``, or that logged them), the time split of each step, and the timeline.

Definitions (all per training step, as logged): trainer utilisation ``1 - trainer_idle_frac``
(the fraction of the step the trainer computed rather than waited for samples); engine
utilisation ``engine_busy_frac`` (fraction of wall time the engine was generating; async);
slot utilisation ``engine_slot_utilisation`` (mean fraction of the engine's batch slots in
use while it generated). From the timeline: a role's busy fraction is the union of its spans
over the run's span (first span start to last span end).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relayrl.durable import read_jsonl_log
from relayrl.telemetry.metrics import METRICS_FILE, read_metrics
from relayrl.telemetry.plots import Series, line_plot, run_colour, time_split_plot, timeline_plot
from relayrl.telemetry.summary import summarize

__all__ = ["RunData", "load_run", "write_report"]

TIMELINE_FILE = "timeline.json"
PHASES = ("generate", "score", "train", "weight_sync", "wait")


@dataclass
class RunData:
    """One run directory, read: training records (``reward_mean`` logged), eval records
    (``eval/pass_rate`` logged), the config (a dict, empty if absent) and the timeline spans
    per role as (start s since the first span, duration s, name)."""

    name: str
    path: Path
    train: list[dict[str, Any]]
    evals: list[dict[str, Any]]
    config: dict[str, Any] = field(default_factory=dict)
    spans: dict[str, list[tuple[float, float, str]]] = field(default_factory=dict)

    @property
    def schedule(self) -> str:
        return str(self.config.get("schedule", "?"))

    @property
    def algo(self) -> str:
        algo = self.config.get("algo")
        return str(algo.get("name", "?")) if isinstance(algo, dict) else "?"

    def steps(self) -> list[int]:
        return [int(r["step"]) for r in self.train]

    def values(self, key: str) -> list[float]:
        return [_num(r.get(key)) for r in self.train]

    def has(self, key: str) -> bool:
        return any(math.isfinite(_num(r.get(key))) for r in self.train)

    def wall_s(self) -> float:
        """Seconds from the first span's start to the last span's end (the timeline), else
        the sum of ``time/step``."""
        ends = [s + d for spans in self.spans.values() for s, d, _ in spans]
        if ends:
            return max(ends)
        return math.fsum(v for v in self.values("time/step") if math.isfinite(v))

    def busy_fraction(self, role: str) -> float:
        """Union of ``role``'s spans / ``wall_s`` (NaN without a timeline)."""
        spans = sorted((s, s + d) for s, d, _ in self.spans.get(role, []))
        wall = self.wall_s()
        if not spans or wall <= 0:
            return math.nan
        busy, cur_s, cur_e = 0.0, spans[0][0], spans[0][1]
        for s, e in spans[1:]:
            if s > cur_e:
                busy += cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        return (busy + cur_e - cur_s) / wall


def _num(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return math.nan
    return float(v)


def _read_config(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML ({e})") from e
    return data if isinstance(data, dict) else {}


def _read_timeline(path: Path) -> dict[str, list[tuple[float, float, str]]]:
    if not path.exists():
        return {}
    try:
        trace = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg})") from e
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else []
    spans = [e for e in events if isinstance(e, dict) and e.get("ph") == "X"]
    if not spans:
        return {}
    t0 = min(float(span["ts"]) for span in spans)
    out: dict[str, list[tuple[float, float, str]]] = {}
    for span in spans:
        role = str(span.get("cat", "?"))
        out.setdefault(role, []).append(
            (
                (float(span["ts"]) - t0) / 1e6,
                float(span.get("dur", 0.0)) / 1e6,
                str(span.get("name", "?")),
            )
        )
    return out


def load_run(path: str | Path, name: str | None = None) -> RunData:
    """Read a run directory (``metrics.jsonl`` required; timeline and config optional)."""
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"{p}: no such run directory")
    if not (p / METRICS_FILE).exists():
        raise FileNotFoundError(f"{p / METRICS_FILE}: no such file (is {p} a relayrl run?)")
    records = read_metrics(p)
    train = [r for r in records if "reward_mean" in r]
    evals = [r for r in records if "eval/pass_rate" in r]
    if not train and not evals:
        raise ValueError(f"{p / METRICS_FILE}: no training step recorded yet")
    return RunData(
        name or p.resolve().name,
        p,
        train,
        evals,
        _read_config(p / "config.yaml"),
        _read_timeline(p / TIMELINE_FILE),
    )


def _unique_names(paths: Sequence[Path]) -> list[str]:
    """Directory names; where two runs share one, their parent is prefixed."""
    names = [p.resolve().name for p in paths]
    for i, p in enumerate(paths):
        if names.count(p.resolve().name) > 1:
            names[i] = f"{p.resolve().parent.name}/{p.resolve().name}"
    return names


# (file, title, y label, [(key, label suffix, line style)], y limits, percent)
CURVES: list[tuple[str, str, str, list[tuple[str, str, str]], Any, bool]] = [
    ("reward", "Reward", "mean reward per answer", [("reward_mean", "", "-")], None, False),
    (
        "kl",
        "KL to the reference policy",
        "KL estimate (nats per token)",
        [("kl", "", "-")],
        None,
        False,
    ),
    ("entropy", "Policy entropy", "entropy (nats per token)", [("entropy", "", "-")], None, False),
    (
        "response_length",
        "Response length",
        "tokens per answer",
        [("response_length_mean", " mean", "-"), ("response_length_max", " max", ":")],
        (0, None),
        False,
    ),
    (
        "clip_fraction",
        "PPO clip fraction",
        "fraction of tokens clipped",
        [("clipfrac", "", "-")],
        (0, None),
        True,
    ),
    (
        "throughput",
        "Throughput",
        "tokens per second",
        [("gen_tokens_per_s", " generate", "-"), ("train_tokens_per_s", " train", "--")],
        (0, None),
        False,
    ),
]
ASYNC_CURVES: list[tuple[str, str, str, list[tuple[str, str, str]], Any, bool]] = [
    (
        "staleness",
        "Staleness of the trained samples",
        "policy versions behind",
        [("staleness_mean", " mean", "-"), ("staleness_max", " max", ":")],
        (0, None),
        False,
    ),
    (
        "utilisation",
        "Engine and trainer utilisation",
        "fraction of the step",
        [
            ("engine_busy_frac", " engine busy", "-"),
            ("engine_slot_utilisation", " engine slots", ":"),
            ("trainer_busy", " trainer busy", "--"),
        ],
        (0, 1.05),
        True,
    ),
]


def _with_derived(run: RunData) -> None:
    for r in run.train:
        idle = _num(r.get("trainer_idle_frac"))
        if math.isfinite(idle):
            r["trainer_busy"] = 1.0 - idle


def _curve_figure(out: Path, runs: Sequence[RunData], spec: tuple) -> str | None:
    name, title, ylabel, keys, ylim, percent = spec
    series = []
    for i, run in enumerate(runs):
        for key, suffix, style in keys:
            if run.has(key):
                series.append(
                    Series(
                        run.steps(), run.values(key), f"{run.name}{suffix}", run_colour(i), style
                    )
                )
    if not series:
        return None
    line_plot(out / f"{name}.png", series, title, ylabel, ylim=ylim, percent=percent)
    return f"{name}.png"


def _pass_rate_figure(out: Path, runs: Sequence[RunData]) -> str | None:
    series = []
    for i, run in enumerate(runs):
        if run.has("pass_rate"):
            series.append(
                Series(run.steps(), run.values("pass_rate"), f"{run.name} training", run_colour(i))
            )
        if run.evals:
            xs = [int(r["step"]) for r in run.evals]
            ys = [_num(r["eval/pass_rate"]) for r in run.evals]
            series.append(Series(xs, ys, f"{run.name} held-out", run_colour(i), "--", "s"))
    if not series:
        return None
    line_plot(
        out / "pass_rate.png",
        series,
        "Pass rate (answers scored correct)",
        "fraction correct",
        ylim=(-0.02, 1.02),
        percent=True,
    )
    return "pass_rate.png"


def _phases(run: RunData) -> dict[str, list[float]]:
    phases = {p: run.values(f"time/{p}") for p in PHASES if run.has(f"time/{p}")}
    total = run.values("time/step")
    other = []
    for i, t in enumerate(total):
        known = math.fsum(v[i] for v in phases.values() if math.isfinite(v[i]))
        other.append(max(t - known, 0.0) if math.isfinite(t) else math.nan)
    phases["other"] = other
    return phases


def _md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines


def _f(x: float, fmt: str = ".3g") -> str:
    return "-" if not math.isfinite(x) else format(x, fmt)


def _pct(x: float) -> str:
    return "-" if not math.isfinite(x) else f"{100 * x:.1f}%"


SUMMARY_ROWS = [
    ("reward_mean", "reward (mean answer)"),
    ("pass_rate", "training pass rate"),
    ("kl", "KL (nats/token)"),
    ("entropy", "entropy (nats/token)"),
    ("response_length_mean", "response length (tokens)"),
    ("clipfrac", "clip fraction"),
    ("staleness_mean", "staleness (versions)"),
    ("time/step", "step time (s)"),
]


def write_report(
    run_dirs: Sequence[str | Path], out_dir: str | Path, title: str | None = None
) -> Path:
    """Write ``out_dir/report.md`` and its PNGs for ``run_dirs``; returns the report's path.

    Raises ``FileNotFoundError`` / ``ValueError`` naming the run directory or file at fault,
    and ``PlotsUnavailable`` when matplotlib is missing (before anything is written)."""
    from relayrl.telemetry.plots import require_matplotlib

    require_matplotlib()
    paths = [Path(p) for p in run_dirs]
    if not paths:
        raise ValueError("relayrl report needs at least one run directory")
    runs = [load_run(p, n) for p, n in zip(paths, _unique_names(paths), strict=True)]
    for run in runs:
        _with_derived(run)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    lines = [f"# {title or 'relayrl run report'}", ""]
    header = ["run", "directory", "algorithm", "schedule", "steps", "wall (s)"]
    header += ["held-out pass rate: first -> last eval"]
    rows = []
    for run in runs:
        ev = [_num(r["eval/pass_rate"]) for r in run.evals]
        evs = f"{_pct(ev[0])} -> {_pct(ev[-1])}" if ev else "-"
        rel = str(run.path)  # as given on the command line
        steps = str(max(run.steps())) if run.train else "0"
        rows.append([run.name, f"`{rel}`", run.algo, run.schedule, steps, _f(run.wall_s(), ".1f")])
        rows[-1].append(evs)
    lines += _md_table(header, rows)

    keys = [k for k, _ in SUMMARY_ROWS]
    stats = [summarize(run.train, keys) for run in runs]
    lines += ["", "## Summary", "", "Last value (mean over the run in brackets)."]
    srows = []
    for key, label in SUMMARY_ROWS:
        cells = []
        for s in stats:
            st = s.get(key) or {}
            cells.append(f"{_f(st['last'])} ({_f(st['mean'])})" if st else "-")
        if any(c != "-" for c in cells):
            srows.append([label, *cells])
    lines += [""] + _md_table(["metric", *(r.name for r in runs)], srows)

    figures: list[tuple[str, str, str | None]] = []

    def add(section: str, text: str, png: str | None) -> None:
        figures.append((section, text, png))

    add(
        "Reward",
        "Mean reward of the answers trained on, per step.",
        _curve_figure(out, runs, CURVES[0]),
    )
    add(
        "Pass rate",
        "Solid: fraction of the step's training answers scored correct. Dashed squares: the "
        "held-out eval (greedy unless `eval.n` > 1).",
        _pass_rate_figure(out, runs),
    )
    for spec, text in zip(
        CURVES[1:],
        [
            "Estimated KL divergence of the policy from the reference: the loss's KL term, a "
            "token mean (a KL in the reward is measured as `algo.adaptive_kl_metric` says); "
            "0 when neither uses one.",
            "Mean per-token entropy of the policy on the trained answers.",
            "Answer lengths in tokens (solid: mean, dotted: longest).",
            "Fraction of answer tokens whose importance ratio the PPO objective clipped.",
            "Generated tokens per second of generation time, trained tokens per second of "
            "training time.",
        ],
        strict=True,
    ):
        add(spec[1], text, _curve_figure(out, runs, spec))
    if any(r.schedule != "sync" or any(v > 0 for v in r.values("staleness_max")) for r in runs):
        add(
            ASYNC_CURVES[0][1],
            "How many policy versions behind the trainer the behaviour policy of the trained "
            "samples was (mean and largest per step; 0 for a synchronous run).",
            _curve_figure(out, runs, ASYNC_CURVES[0]),
        )
        add(
            ASYNC_CURVES[1][1],
            "Engine busy: fraction of wall time the engine was generating (async). Engine "
            "slots: mean fraction of its batch slots in use while generating. Trainer busy: "
            "`1 - trainer_idle_frac`, the fraction of the step the trainer computed.",
            _curve_figure(out, runs, ASYNC_CURVES[1]),
        )
    timed = [(r.name, r.steps(), _phases(r)) for r in runs if r.has("time/step")]
    if timed:
        time_split_plot(out / "time_split.png", timed)
        add(
            "Time per step",
            "Seconds of each step by phase as the trainer saw it (`time/*`): in async runs "
            "generation overlaps training and shows only as `wait`; `other` is the rest of "
            "`time/step` (advantages, logprobs, bookkeeping).",
            "time_split.png",
        )
        prow = []
        for name, _, phases in timed:
            cells = [_f(_mean(phases.get(p, [])), ".3f") for p in (*PHASES, "other")]
            prow.append([name, *cells])
        figures.append(("", "\n".join(_md_table(["run (mean s)", *PHASES, "other"], prow)), None))
    with_tl = [(r.name, r.spans) for r in runs if r.spans]
    if with_tl:
        timeline_plot(out / "timeline.png", with_tl)
        roles = sorted({role for r in runs for role in r.spans})
        trow = [[r.name, *(_pct(r.busy_fraction(role)) for role in roles)] for r in runs]
        text = (
            "Each role's spans from `timeline.json` (open it in ui.perfetto.dev for detail). "
            "Busy: the union of a role's spans over the run's wall time.\n\n"
            + "\n".join(_md_table(["run (busy)", *roles], trow))
        )
        add("Timeline", text, "timeline.png")

    trows = [_trajectory_row(run) for run in runs]
    if any(trows):
        text = (
            "`trajectories.jsonl` (`train.save_trajectories`): every trained trajectory with "
            "its token ids, loss mask, behaviour logprobs, versions and score.\n\n"
            + "\n".join(
                _md_table(
                    [
                        "run",
                        "steps",
                        "trajectories",
                        "model tokens",
                        "errors",
                        "mean score: first -> last step",
                    ],
                    [r for r in trows if r],
                )
            )
        )
        figures.append(("Trajectories", text, None))

    for section, text, png in figures:
        if section:
            lines += ["", f"## {section}", ""]
        else:
            lines += [""]
        lines.append(text)
        if png:
            lines += ["", f"![{section}]({png})"]
        elif section:
            lines += ["", "(not logged by these runs)"]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _trajectory_row(run: RunData) -> list[str]:
    """A run's saved trajectories summarised (``relayrl.env.export``'s file), [] if none."""
    path = run.path / "trajectories.jsonl"
    if not path.exists():
        return []
    per_step: dict[int, list[float]] = {}
    tokens = errors = 0
    for _, r in read_jsonl_log(path):  # a torn last line (a killed append): skipped, warned
        per_step.setdefault(int(r["step"]), []).append(float(r.get("score") or 0.0))
        tokens += sum(r.get("loss_mask") or [])
        errors += r.get("error") is not None
    if not per_step:
        return []
    steps = sorted(per_step)
    first, last = _mean(per_step[steps[0]]), _mean(per_step[steps[-1]])
    n = sum(len(v) for v in per_step.values())
    return [
        run.name,
        str(len(steps)),
        str(n),
        str(tokens),
        str(errors),
        f"{_f(first)} -> {_f(last)}",
    ]


def _mean(xs: list[float]) -> float:
    vals = [x for x in xs if math.isfinite(x)]
    return math.fsum(vals) / len(vals) if vals else math.nan
