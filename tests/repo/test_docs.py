"""The documentation holds: docs/extending.md's worked examples run, the generated module map
(docs/modules.md, ``tools/module_map.py``) is current, every file a page names or links exists,
and the README stays a front door (at most 150 lines)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md")), ROOT / "bench" / "README.md"]
PAGES.append(ROOT / "tests" / "README.md")
GENERATED = {DOCS / "modules.md", DOCS / "config.md"}  # written from the tree and the schema


def _sections(page: Path) -> dict[str, list[str]]:
    """``{section title: [python block, ...]}``; blocks before the first ``##`` are ``""``."""
    out: dict[str, list[str]] = {"": []}
    title = ""
    for part in re.split(r"^(## .*)$", page.read_text(), flags=re.M):
        if part.startswith("## "):
            title = part[3:].strip()
            out[title] = []
        else:
            out[title] += re.findall(r"```python\n(.*?)```", part, flags=re.S)
    return out


EXAMPLES = {k: v for k, v in _sections(DOCS / "extending.md").items() if k and v}


@pytest.mark.parametrize("section", sorted(EXAMPLES))
def test_extending_examples_run(section: str, tmp_path, monkeypatch) -> None:
    """Each section's blocks in order, after the page's opening blocks (the tiny model), in one
    namespace, in a temporary directory; the registries it adds to are put back after."""
    from relayrl.algos import POLICY_LOSSES
    from relayrl.reward.functions import REWARD_FUNCTIONS

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    saved_losses, saved_rewards = dict(POLICY_LOSSES), dict(REWARD_FUNCTIONS)
    namespace: dict[str, object] = {"__name__": f"extending_{section[:10]}"}
    try:
        for block in _sections(DOCS / "extending.md")[""] + EXAMPLES[section]:
            exec(compile(block, f"docs/extending.md ({section})", "exec"), namespace)
    finally:
        POLICY_LOSSES.clear()
        POLICY_LOSSES.update(saved_losses)
        REWARD_FUNCTIONS.clear()
        REWARD_FUNCTIONS.update(saved_rewards)
        for name in ("my_rewards", "my_envs"):
            sys.modules.pop(name, None)


def test_extending_has_the_four_examples() -> None:
    titles = set(EXAMPLES)
    for kind in ("loss", "reward", "environment", "rollout backend"):
        assert any(kind in t for t in titles), (kind, titles)


def test_module_map_is_current() -> None:
    spec = importlib.util.spec_from_file_location("module_map", ROOT / "tools" / "module_map.py")
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert (DOCS / "modules.md").read_text() == tool.render(), (
        "docs/modules.md is stale: run `python tools/module_map.py` and commit it"
    )


def test_readme_is_a_front_door() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, f"README.md is {len(lines)} lines: move detail into docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_and_named_files_exist(page: Path) -> None:
    """Relative links resolve, and every source path a page names (``controller/trainer.py``,
    ``src/relayrl/config.py``, ``tests/test_x.py``, ``bench/x.py``, ``tools/x.py``) exists."""
    text = page.read_text()
    missing = []
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" not in target and not (page.parent / target).exists():
            missing.append(f"link {target}")
    named = set() if page in GENERATED else set(re.findall(r"`((?:\w[\w.]*/)+[\w.]+\.py)`", text))
    for path in named:
        candidates = [ROOT / path, ROOT / "src" / path, ROOT / "src" / "relayrl" / path]
        if not any(c.exists() for c in candidates):
            missing.append(f"file {path}")
    assert not missing, f"{page.relative_to(ROOT)}: " + ", ".join(sorted(missing))


def test_bench_index_lists_every_script() -> None:
    index = (ROOT / "bench" / "README.md").read_text()
    missing = [p.name for p in sorted((ROOT / "bench").glob("*.py")) if f"`{p.name}`" not in index]
    assert not missing, f"bench/README.md does not list {missing}: add a row for each"
