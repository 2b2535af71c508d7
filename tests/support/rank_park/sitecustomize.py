"""Park rank 1 of an FSDP2 pool while it writes its part of a sharded checkpoint, for a SIGKILL
from outside (tests/integration/test_fsdp_crash_resume.py). On ``PYTHONPATH`` this module runs
at the start of every Python process, the Ray workers too; it acts only where
``$RELAYRL_PARK_RANK_FILE`` names a marker file: when ``relayrl.workers.fsdp`` is imported,
``torch.save`` is wrapped so that the ``$RELAYRL_PARK_NTH``-th save of ``rank_1.pt`` (rank 1's
scheduler and generator, the last file of its part; rank 0 has written all of its own by then
and waits for rank 1) creates the marker and sleeps instead (with ``$RELAYRL_PARK_FAIL`` set:
raises ENOSPC, a full disk on rank 1 only)."""

from __future__ import annotations

import errno
import importlib.abc
import importlib.util
import os
import sys
import time
from pathlib import Path
from typing import Any

TARGET = "relayrl.workers.fsdp"


def _install(module: Any) -> None:
    torch = module.torch
    real_save = torch.save
    seen = {"n": 0}
    nth = int(os.environ.get("RELAYRL_PARK_NTH", "1"))

    def save(obj: Any, f: Any, *a: Any, **k: Any) -> Any:
        if Path(str(f)).name == "rank_1.pt":
            seen["n"] += 1
            if seen["n"] == nth:
                Path(os.environ["RELAYRL_PARK_RANK_FILE"]).write_text(f"{os.getpid()}\n")
                if os.environ.get("RELAYRL_PARK_FAIL"):
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                while True:
                    time.sleep(1)
        return real_save(obj, f, *a, **k)

    torch.save = save


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        real_exec = loader.exec_module

        def exec_module(module: Any) -> None:
            real_exec(module)
            _install(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if os.environ.get("RELAYRL_PARK_RANK_FILE"):
    sys.meta_path.insert(0, _Hook())
