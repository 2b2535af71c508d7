"""Compiling the CPU kernels (``varlen_decode.c`` then ``step_kernels.c``, one library).

The library is built once per machine with the system C compiler (``$CC``, else ``cc``) into
``$RELAYRL_CACHE_DIR/kernels`` (default ``~/.cache/relayrl/kernels``) and loaded with
``ctypes``. Its file name is ``relayrl_cpu_<source>_<build>.so``: ``<source>`` hashes the C
sources, ``<build>`` the flags, the compiler's ``--version`` line, the machine
(``platform.machine()``) and the operating system, so a home directory shared by machines of
different architectures or compilers never loads a library built for another. Builds of other
sources (older relayrl versions) and of the old ``varlen_decode_*.so`` naming are removed when a
new one is written; builds of the same sources for other machines or flags are kept.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SOURCES = ("varlen_decode.c", "step_kernels.c")
"""Compiled as one unit, in this order (the step's pieces call the kernel's helpers)."""

FLAGS = ("-O3", "-fno-fast-math", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC")
"""No reassociation, no fused multiply-adds: the source's order is the order that runs."""

PREFIX = "relayrl_cpu_"


def source() -> str:
    """The C of the library: the files of ``SOURCES`` joined."""
    return "\n".join((HERE / name).read_text() for name in SOURCES)


def cache_dir() -> Path:
    root = os.environ.get("RELAYRL_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "relayrl"
    )
    return Path(root) / "kernels"


def compiler() -> str:
    return os.environ.get("CC", "cc")


@cache
def compiler_version(cc: str) -> str:
    """The first line of ``cc --version`` (raises OSError when there is no such compiler)."""
    res = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    if res.returncode != 0:
        raise OSError(f"{cc} --version failed: {res.stderr.strip()[:200]}")
    return (res.stdout.splitlines() or [""])[0].strip()


def library_name(text: str, flags: tuple[str, ...], cc_version: str, machine: str) -> str:
    """``relayrl_cpu_<sha256(text)[:12]>_<sha256(flags, compiler, machine, os)[:12]>.so``."""
    src = hashlib.sha256(text.encode()).hexdigest()[:12]
    where = "\n".join([" ".join(flags), cc_version, machine, platform.system()])
    return f"{PREFIX}{src}_{hashlib.sha256(where.encode()).hexdigest()[:12]}.so"


def clean_old_builds(out_dir: Path, current: str) -> list[Path]:
    """Remove the builds of other sources than ``current``'s (and the old ``varlen_decode_*``
    names); returns what was removed. Builds of the same sources for other machines stay."""
    keep = current[: len(PREFIX) + 12]
    removed = []
    for path in [*out_dir.glob(f"{PREFIX}*.so"), *out_dir.glob("varlen_decode_*.so")]:
        if not path.name.startswith(keep):
            try:
                path.unlink()
                removed.append(path)
            except OSError:
                pass  # another process's: left for the next build
    return removed


def build(defines: tuple[str, ...] = ()) -> ctypes.CDLL:
    """Compile the library once per source, flags, compiler and machine (atomic rename:
    concurrent builders never see a partial file) and load it. ``defines``, e.g.
    ``("-DRELAYRL_SCALAR",)``: the plain C path."""
    flags, cc, text = FLAGS + tuple(defines), compiler(), source()
    out_dir = cache_dir()
    lib = out_dir / library_name(text, flags, compiler_version(cc), platform.machine())
    if not lib.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
            src = Path(tmp) / "relayrl_cpu.c"
            src.write_text(text)
            part = Path(tmp) / lib.name
            cmd = [cc, *flags, str(src), "-o", str(part)]
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if res.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed: {res.stderr.strip()[:500]}")
            os.replace(part, lib)
        clean_old_builds(out_dir, lib.name)
    return _bind(ctypes.CDLL(str(lib)))


def _bind(handle: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the argument and result types of the library's entry points."""
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    fn = handle.decode_attention_f32
    fn.argtypes = [ptr] * 6 + [i64] * 5 + [ctypes.c_float, ptr, i64]
    fn.restype = None
    layer = handle.attend_layer_f32
    pairs: list[Any] = [ptr, i64] * 3
    layer.argtypes = pairs + [ptr] * 8 + [i64] * 5 + [ctypes.c_float, ptr, i64]
    layer.restype = None
    rms = handle.add_rms_f32
    rms.argtypes = [ptr] * 5 + [i64] * 2 + [ctypes.c_float, i64]
    rms.restype = None
    draw = handle.sample_rows_f32
    head: list[Any] = [ptr, i64, ptr, ptr, i64, i64]
    draw.argtypes = head + [ptr] * 6
    draw.restype = None
    handle.relayrl_wide.restype = ctypes.c_int
    handle.relayrl_set_wide.argtypes = [ctypes.c_int]
    handle.relayrl_set_wide.restype = ctypes.c_int
    return handle
