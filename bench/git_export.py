"""A commit's ``src`` tree exported into a temporary directory, for benches that compare the
checkout with an earlier ref (``bench/code_reward.py``, ``bench/math_agreement.py``)."""

from __future__ import annotations

import contextlib
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def src_at(ref: str, prefix: str = "relayrl-bench-before-") -> Iterator[Path]:
    """``ref``'s ``src`` (``git archive ref src``, untarred), removed on exit. A ref git does
    not know is a ``SystemExit`` naming it."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "archive", ref, "src"], capture_output=True, check=False
        )
        if out.returncode != 0:
            raise SystemExit(f"git archive {ref} src: {out.stderr.decode().strip()}")
        subprocess.run(["tar", "-x", "-C", tmp], input=out.stdout, check=True)
        yield Path(tmp) / "src"
