"""The CPU kernels' build: real ``.c`` files, a library name keyed by the sources and by the
flags, compiler and machine, and old builds removed when a new one is written."""

from __future__ import annotations

import os
import subprocess
import sys

from relayrl.rollout.cpu_kernels import build

FLAGS = build.FLAGS


def test_the_sources_are_c_files_in_the_package() -> None:
    for name in build.SOURCES:
        text = (build.HERE / name).read_text()
        assert text.startswith("/*") and "#include <stdint.h>" in text
    assert "decode_attention_f32" in build.source() and "sample_rows_f32" in build.source()


def test_the_name_changes_with_source_flags_compiler_and_machine() -> None:
    base = build.library_name("int x;", FLAGS, "cc (GCC) 12.2.0", "x86_64")
    assert base.startswith("relayrl_cpu_") and base.endswith(".so")
    others = [
        build.library_name("int y;", FLAGS, "cc (GCC) 12.2.0", "x86_64"),
        build.library_name("int x;", (*FLAGS, "-DRELAYRL_SCALAR"), "cc (GCC) 12.2.0", "x86_64"),
        build.library_name("int x;", FLAGS, "clang version 17.0.6", "x86_64"),
        build.library_name("int x;", FLAGS, "cc (GCC) 12.2.0", "aarch64"),
    ]
    assert len({base, *others}) == 5
    # the source part is the same for the same sources whatever the machine
    assert {n[: len("relayrl_cpu_") + 12] for n in [base, *others[1:]]} == {base[:24]}


def test_a_new_build_removes_the_builds_of_other_sources(tmp_path) -> None:
    """A fresh cache gets one library; the builds of other sources (older versions, and the old
    ``varlen_decode_*`` naming) go, the same sources' builds for another machine stay."""
    out = tmp_path / "kernels"
    out.mkdir()
    current = build.library_name(build.source(), FLAGS, "v", "m")
    stale = [out / "varlen_decode_0123456789abcdef.so", out / "relayrl_cpu_000000000000_x.so"]
    sibling = out / (current[:24] + "_otherosarch.so")
    for path in [*stale, sibling]:
        path.write_bytes(b"")
    code = (
        "from relayrl.rollout.cpu_kernels import build\n"
        "lib = build.build()\n"
        "print(lib.relayrl_wide() in (0, 1))\n"
    )
    env = {**os.environ, "RELAYRL_CACHE_DIR": str(tmp_path)}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.strip() == "True", res.stderr
    names = sorted(p.name for p in out.iterdir())
    assert sibling.name in names and not any(p.name in names for p in stale), names
    built = [n for n in names if n != sibling.name]
    assert len(built) == 1 and built[0].startswith(current[:24]), names


def test_the_compiler_version_is_part_of_the_key() -> None:
    """``cc --version``'s first line is read once per compiler; a missing one is an OSError."""
    cc = build.compiler()
    assert (
        build.compiler_version(cc)
        == subprocess.run([cc, "--version"], capture_output=True, text=True)
        .stdout.splitlines()[0]
        .strip()
    )
    try:
        build.compiler_version("no-such-cc-relayrl")
    except OSError as e:
        assert "no-such-cc-relayrl" in str(e)
    else:
        raise AssertionError("a missing compiler must raise OSError")
