"""Streaming from ``relayrl serve``: time to the first token chunk against the whole call.

Starts ``relayrl serve`` on a tiny model (its own process, one torch thread), then for chat and
completions asks ``--tokens`` greedy tokens (``ignore_eos``) ``--repeats`` times, unstreamed
and streamed, with the official ``openai`` client in this process; prints per call the
unstreamed call's seconds, the streamed call's first chunk with tokens (ms) and last chunk (s),
and how many chunks carried tokens (fewer than the tokens when the client falls behind the
engine: waiting tokens are merged into one chunk). Prints one JSON line.

    python bench/serve_stream.py                 # ~10 s on 2 cores
    python bench/serve_stream.py --tokens 2000
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    import openai

    from relayrl.model import build_tiny_model

    path = build_tiny_model(Path(tempfile.mkdtemp()) / "tiny", max_position_embeddings=4096)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "relayrl.cli", "serve", str(path), "--port", "0"]
    proc = subprocess.Popen(cmd + ["--threads", "1"], stdout=subprocess.PIPE, text=True, env=env)
    rows: list[dict[str, Any]] = []
    try:
        url = (proc.stdout.readline() if proc.stdout else "").split(" at ")[-1].strip()
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=600)
        for kind in ("chat", "completion"):
            kw: dict[str, Any] = dict(
                model="tiny", max_tokens=args.tokens, temperature=0, extra_body={"ignore_eos": True}
            )
            if kind == "chat":
                kw["messages"] = [{"role": "user", "content": "12+3="}]
                call: Any = client.chat.completions.create
            else:
                kw["prompt"] = "12+3="
                call = client.completions.create
            call(**{**kw, "max_tokens": 4})  # warm up
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                call(**kw)
                plain = time.perf_counter() - t0
                t0 = time.perf_counter()
                first, chunks = None, 0
                for ch in call(stream=True, **kw):
                    if ch.choices and (ch.choices[0].model_extra or {}).get("token_ids"):
                        chunks += 1
                        first = first if first is not None else time.perf_counter() - t0
                rows.append(
                    {
                        "kind": kind,
                        "unstreamed_s": round(plain, 3),
                        "first_chunk_ms": round(1000 * (first or 0.0), 1),
                        "last_chunk_s": round(time.perf_counter() - t0, 3),
                        "token_chunks": chunks,
                    }
                )
                print(rows[-1], file=sys.stderr, flush=True)
    finally:
        proc.terminate()
        proc.wait(30)
    print(json.dumps({"tokens": args.tokens, "calls": rows}))


if __name__ == "__main__":
    main()
