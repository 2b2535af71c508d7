"""The house drawn from the imports (docs/architecture.md "Layers"): lower layers never import
higher ones, no two modules import each other (directly or round a longer circle), and no source
or test file is over 600 lines.

Every module under ``src/relayrl`` is read with ``ast`` (imports inside functions and under
``TYPE_CHECKING`` count: they are dependencies too; relative imports are resolved). A module's
layer is its top-level package (``relayrl.reward.service`` -> ``reward``) or, for a top-level
module, its name (``relayrl.cli`` -> ``cli``). The floors, lowest first:

    algos < model < rollout < reward < data < env < workers < controller < cluster < apps

with the applications (``cli``, ``demo``, ``labs``, ``tinker``) on one top floor. ``plan`` and
``telemetry`` are leaves that anything may import and that import no other relayrl package but
the config and the base; ``config*.py`` modules are leaves that import only each other and the
base. The base (``durable``: fsync and torn-line helpers on the standard library alone) lies
under everything: every module may import it, and it imports no relayrl module. A module may
import its own layer and any lower one. A package or module missing from these lists fails the
test, so a new one has to be given a floor.

Import circles are found on the module graph (``from relayrl.workers import fsdp`` is an edge to
``relayrl.workers.fsdp``; a package's ``__init__`` is a module of its own, and importing
``relayrl.x.y`` is not counted as importing ``relayrl.x``): every strongly connected component
of more than one module is a circle, lazy imports inside functions included.
"""

from __future__ import annotations

import ast
from pathlib import Path

import relayrl

SRC = Path(relayrl.__file__).parent
TESTS = Path(__file__).resolve().parents[1]
FLOORS = ["algos", "model", "rollout", "reward", "data", "env", "workers", "controller", "cluster"]
APPS = {"cli", "demo", "labs", "tinker"}
LEAVES = {"plan", "telemetry"}
BASE = {"durable"}
MAX_LINES = 600
# Files over MAX_LINES that another change is splitting; each entry must still be over the
# limit (so it is removed when the split lands) and names who splits it. Keys: the path under
# src/relayrl (KNOWN_LONG) or under tests/ (KNOWN_LONG_TESTS).
KNOWN_LONG: dict[str, str] = {}
KNOWN_LONG_TESTS: dict[str, str] = {}


def _floor(layer: str) -> int:
    """The floor number of a layer: algos 1 ... cluster 9, the applications above."""
    if layer in APPS:
        return len(FLOORS) + 1
    return FLOORS.index(layer) + 1


def _layer_of(module: str) -> str:
    """``relayrl.reward.service`` -> ``reward``; ``relayrl`` itself -> ``relayrl``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _module_name(path: Path, src: Path = SRC) -> str:
    rel = path.relative_to(src.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, src: Path = SRC) -> list[tuple[int, str]]:
    """(line, absolute module) for every ``relayrl`` import in the file, relative ones resolved.

    ``from relayrl.x import y`` yields ``relayrl.x`` (``y`` lies in the same layer), and
    ``from relayrl import x, y`` yields ``relayrl.x`` and ``relayrl.y``.
    """
    module = _module_name(path, src)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "relayrl":  # ``from relayrl import reward``: the names are the layers
                out += [(node.lineno, f"relayrl.{a.name}") for a in node.names]
            else:
                out.append((node.lineno, target))
    return sorted((line, name) for line, name in out if name.split(".")[0] == "relayrl")


def layer_violations(src: Path = SRC) -> list[str]:
    """Every import that points up a floor or out of a leaf, as ``file:line: a imports b``."""
    bad: list[str] = []
    for path in sorted(src.rglob("*.py")):
        src_layer = _layer_of(_module_name(path, src))
        rel = path.relative_to(src)
        for line, target in imports_of(path, src):
            dst = _layer_of(target)
            where = f"{rel}:{line}: {src_layer} imports {target}"
            if dst == src_layer or dst == "relayrl":
                continue
            if src_layer in BASE:
                bad.append(f"{where} ({src_layer} is the base: it imports no relayrl module)")
            elif dst in BASE:
                continue  # every module may use the base
            elif src_layer.startswith("config"):
                if not dst.startswith("config"):
                    bad.append(f"{where} (config modules are leaves)")
            elif dst.startswith("config") or dst in LEAVES and src_layer not in LEAVES:
                continue  # anything may use the config and the leaves
            elif src_layer in LEAVES:
                bad.append(f"{where} ({src_layer} is a leaf: it imports only the config)")
            elif src_layer == "relayrl":
                bad.append(f"{where} (the package root imports nothing)")
            elif src_layer not in FLOORS and src_layer not in APPS:
                bad.append(f"{where} ({src_layer} has no floor in tests/repo/test_layers.py)")
            elif dst not in FLOORS and dst not in APPS:
                bad.append(f"{where} ({dst} has no floor in tests/repo/test_layers.py)")
            elif _floor(dst) > _floor(src_layer):
                bad.append(f"{where} (floor {_floor(src_layer)} imports floor {_floor(dst)})")
    return bad


def import_graph(src: Path = SRC) -> dict[str, set[str]]:
    """``{module: the relayrl modules it imports}``, ``from a.b import c`` resolved to the
    module ``a.b.c`` where that is one (else ``a.b``)."""
    paths = {_module_name(p, src): p for p in sorted(src.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(
                        parts[: len(parts) - (node.level - 1)] + ([base] if base else [])
                    )
                deps |= {
                    f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names
                }
        graph[module] = {d for d in deps if d in paths and d != module}
    return graph


def import_circles(src: Path = SRC) -> list[list[str]]:
    """Each set of modules that import each other (a strongly connected component of more than
    one module, Tarjan's algorithm), sorted."""
    graph = import_graph(src)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(circles)


def test_no_import_circles() -> None:
    circles = import_circles()
    assert not circles, "modules that import each other (break the circle):\n" + "\n".join(
        " <-> ".join(c) for c in circles
    )


def test_the_circle_finder_finds_direct_lazy_and_long_circles(tmp_path) -> None:
    files = {
        "__init__.py": "",
        "w/__init__.py": "",
        "w/build.py": "def f():\n    from relayrl.w.lora import X\n",
        "w/lora.py": "from relayrl.w import build\n",
        "w/a.py": "from .b import y\n",
        "w/b.py": "from relayrl.w.c import z\n",
        "w/c.py": "import relayrl.w.a\n",
        "w/leaf.py": "from relayrl.w.a import q\nfrom relayrl import w\n",
    }
    for name, text in files.items():
        (tmp_path / "relayrl" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "relayrl" / name).write_text(text)
    assert import_circles(tmp_path / "relayrl") == [
        ["relayrl.w.a", "relayrl.w.b", "relayrl.w.c"],
        ["relayrl.w.build", "relayrl.w.lora"],
    ]


def test_no_import_points_up_a_floor() -> None:
    bad = layer_violations()
    assert not bad, "imports against the layers (docs/architecture.md):\n" + "\n".join(bad)


def test_every_package_has_a_floor() -> None:
    known = set(FLOORS) | APPS | LEAVES | BASE
    for path in SRC.iterdir():
        name = path.stem if path.suffix == ".py" else path.name
        if path.name.startswith(("_", ".")) or name.startswith("config"):
            continue
        if path.is_dir() and not (path / "__init__.py").exists():
            continue
        assert name in known, f"src/relayrl/{path.name} has no floor in tests/repo/test_layers.py"


def test_the_checker_finds_each_kind_of_violation(tmp_path) -> None:
    """The checker on a made-up tree: an upward import hidden in a function, a relative one, a
    leaf importing a floor, a config module importing a layer, a package with no floor, and
    the base importing anything (a leaf importing the base is fine)."""
    files = {
        "__init__.py": "",
        "config_x.py": "from relayrl.model import tiny\n",
        "model/__init__.py": "",
        "model/a.py": (
            "from relayrl.algos import kl\nfrom relayrl import telemetry, config\n"
            "def f():\n    from relayrl.controller import trainer\n"
            "from ..cluster import local\n"
        ),
        "telemetry/__init__.py": "from relayrl.reward import score\nfrom . import metrics\n",
        "labs/lab.py": "from relayrl.cluster import local\nfrom relayrl.cli import main\n",
        "attic/old.py": "from relayrl.model import a\n",
        "durable.py": "from relayrl.config import x\n",
        "plan/p.py": "from relayrl.durable import fsync_dir\n",
    }
    for name, text in files.items():
        (tmp_path / "relayrl" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "relayrl" / name).write_text(text)
    bad = layer_violations(tmp_path / "relayrl")
    assert bad == [
        "attic/old.py:1: attic imports relayrl.model"
        " (attic has no floor in tests/repo/test_layers.py)",
        "config_x.py:1: config_x imports relayrl.model (config modules are leaves)",
        "durable.py:1: durable imports relayrl.config (durable is the base: it imports no "
        "relayrl module)",
        "model/a.py:4: model imports relayrl.controller (floor 2 imports floor 8)",
        "model/a.py:5: model imports relayrl.cluster (floor 2 imports floor 9)",
        "telemetry/__init__.py:1: telemetry imports relayrl.reward "
        "(telemetry is a leaf: it imports only the config)",
    ]


def long_files(root: Path, known: dict[str, str], name: str = "KNOWN_LONG") -> list[str]:
    """One line for each ``*.py`` under ``root`` over ``MAX_LINES`` lines and not in ``known``
    (keyed by the path under ``root``), and for each entry of ``known`` (called ``name``) that
    is no longer over the limit."""
    bad = []
    for path in sorted(root.rglob("*.py")):
        rel = str(path.relative_to(root))
        n = len(path.read_text().splitlines())
        if rel in known and n <= MAX_LINES:
            bad.append(f"{rel} is {n} lines now: remove it from {name}")
        elif rel not in known and n > MAX_LINES:
            bad.append(f"{rel}: {n} lines (at most {MAX_LINES}): split it along its seams")
    return bad


def test_no_source_file_over_600_lines() -> None:
    bad = long_files(SRC, KNOWN_LONG)
    assert not bad, "\n".join(bad)


def test_no_test_file_over_600_lines() -> None:
    """Test modules, ``support/`` and ``conftest.py`` too: split a long test module into
    modules named for what they test (shared set-up in ``support/``)."""
    bad = long_files(TESTS, KNOWN_LONG_TESTS, "KNOWN_LONG_TESTS")
    assert not bad, "\n".join(bad)


def test_long_files_names_files_over_the_limit_and_stale_entries(tmp_path: Path) -> None:
    """601 lines is over, 600 is not; a known entry over the limit is quiet, and one at or
    under it is named for removal."""
    (tmp_path / "unit").mkdir()
    for name, n in {"unit/over.py": 601, "at.py": 600, "known.py": 700, "shrunk.py": 12}.items():
        (tmp_path / name).write_text("x = 1\n" * n)
    (tmp_path / "notes.txt").write_text("x\n" * 900)  # not Python: not counted
    known = {"known.py": "issue 1", "shrunk.py": "issue 2"}
    assert long_files(tmp_path, known, "KNOWN") == [
        "shrunk.py is 12 lines now: remove it from KNOWN",
        "unit/over.py: 601 lines (at most 600): split it along its seams",
    ]
