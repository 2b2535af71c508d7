"""``relayrl tinker-serve MODEL_DIR [MODEL_DIR ...] [--port N]``: the Tinker-compatible
training service in the foreground until Ctrl-C / SIGTERM (or ``--seconds``)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any


def cmd_tinker_serve(args: argparse.Namespace) -> int:
    from relayrl.model import check_model_dir, set_threads
    from relayrl.tinker.server import TinkerServer
    from relayrl.tinker.service import TinkerService

    for d in args.model_dirs:
        check_model_dir(d)
    if args.threads:
        set_threads(args.threads)
    service = TinkerService(
        [Path(d) for d in args.model_dirs],
        args.state_dir,
        seed=args.seed,
        max_slots=args.max_slots,
        keep_samplers=args.keep_samplers,
    )
    server = TinkerServer(service, args.host, args.port, api_key=args.api_key)
    url = server.start()
    print(
        f"relayrl tinker-serve: {url} serving {', '.join(service.bases)}; checkpoints in "
        f"{Path(args.state_dir).resolve()}",
        flush=True,
    )
    try:
        deadline = time.monotonic() + args.seconds if args.seconds else None
        while deadline is None or time.monotonic() < deadline:
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    print("relayrl tinker-serve: stopped", flush=True)
    return 0


def add_subcommand(sub: Any) -> None:
    v = sub.add_parser(
        "tinker-serve", help="serve local models for training through the Tinker SDK's API"
    )
    v.add_argument(
        "model_dirs",
        nargs="+",
        metavar="MODEL_DIR",
        help="Hugging Face model directories (with tokenizers): the base models",
    )
    v.add_argument("--host", default="127.0.0.1")
    v.add_argument("--port", type=int, default=8001, help="0: an ephemeral port")
    v.add_argument(
        "--state-dir",
        default="runs/tinker",
        help="where tinker:// checkpoints are written (kept across restarts)",
    )
    v.add_argument(
        "--api-key",
        help="accept only this key (it must start with 'tml-'); "
        "default: any key starting with 'tml-'",
    )
    v.add_argument("--max-slots", type=int, default=32, help="sequences sampled at once")
    v.add_argument(
        "--keep-samplers",
        type=int,
        default=4,
        help="unnamed samplers (save_weights_and_get_sampling_client) whose weights stay in "
        "memory; older ones expire",
    )
    v.add_argument("--seed", type=int, default=0, help="seeds LoRA init and unseeded samples")
    v.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    v.add_argument("--seconds", type=float, default=0, help="stop after this long (0: never)")
    v.set_defaults(fn=cmd_tinker_serve)
