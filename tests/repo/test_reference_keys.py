"""The hand-written pages name only config keys that exist, and docs/reference.md's table gives
each key the schema's default (docs/config.md is generated and checked by
``test_config_docs.py``; these pages are written by hand and drift when a key is renamed or a
default changes)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PAGES = ["README.md", "docs/first-run.md", "docs/guide.md", "docs/reference.md"]
NOT_KEYS = {"model.safetensors"}  # a file name that starts like a key


def _schema() -> dict[str, Any]:
    """``{dotted key: default}`` of ``relayrl train`` / ``sft`` / ``rm`` (``"..."``: no
    default shown), a Ray pool's keys under ``ray.pools.<name>``."""
    spec = importlib.util.spec_from_file_location("config_docs", ROOT / "tools" / "config_docs.py")
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    from relayrl.config import RunConfig, SFTConfig
    from relayrl.controller.rm_training import RMConfig

    out: dict[str, Any] = {}
    for schema in (RMConfig, SFTConfig, RunConfig):  # the run config's wins a shared name
        for key, _type, default, *_ in tool.rows(schema):
            out[key] = "..." if default in ("", "(required)") else json.loads(default)
    return out


def _literal(text: str) -> Any:
    text = text.strip().strip("`")
    if text.startswith("("):
        return [_literal(t) for t in text.strip("()").split(",")]
    return float(text) if re.fullmatch(r"[-+]?\d+(\.\d*)?(e[-+]?\d+)?", text) else None


def _reference_rows() -> list[tuple[list[str], list[str]]]:
    """(keys, default cells) of each table row of docs/reference.md, shorthand expanded:
    ``rollout.temperature`, `top_p``` -> ``rollout.top_p``; ``algo.adaptive_kl_target` /
    `_horizon``` -> ``algo.adaptive_kl_horizon``."""
    rows = []
    for line in (ROOT / "docs" / "reference.md").read_text().splitlines():
        m = re.match(r"\| (`.*?) \| (.*?) \| .* \|$", line)
        if not m:
            continue
        keys: list[str] = []
        for name in re.findall(r"`([^`]+)`", m.group(1)):
            if "." in name:
                keys.append(name)
            elif name.startswith("_"):  # `_horizon` after `algo.adaptive_kl_target`
                keys.append(keys[0].rsplit("_", 1)[0] + name)
            else:
                keys.append(f"{keys[0].rsplit('.', 1)[0]}.{name}" if keys else name)
        cells = re.split(r"\s+/\s+|,\s*(?![^()]*\))", m.group(2))
        rows.append((keys, cells))
    return rows


def test_reference_table_defaults_are_the_schemas() -> None:
    schema = _schema()
    checked = 0
    wrong = []
    for keys, cells in _reference_rows():
        for key in keys:
            assert key.removesuffix(".*") in {k.rsplit(".", 1)[0] for k in schema} | set(schema), (
                f"docs/reference.md names {key}, which is not a config key"
            )
        if len(cells) != len(keys) or any(k.endswith(".*") for k in keys):
            continue  # a cell that describes ("by algo", "k3 (GRPO) / k1 (PPO)")
        for key, cell in zip(keys, cells, strict=True):
            default = schema[key]
            doc: Any = yaml.safe_load(cell.strip("`")) if cell else None
            if isinstance(default, int | float) and not isinstance(default, bool):
                doc = _literal(cell)
            elif isinstance(default, list):
                doc = _literal(cell)
            if default is None and doc not in (None, "null"):
                continue  # null means "chosen by ..." and the cell says by what
            checked += 1
            if doc != default:
                wrong.append(f"{key}: reference.md says {cell!r}, the schema {default!r}")
    assert not wrong, "; ".join(wrong)
    assert checked >= 60, checked  # 64 key defaults when written


@pytest.mark.parametrize("page", PAGES)
def test_pages_name_only_real_keys(page: str) -> None:
    """Every dotted name under a config section (``algo.kl_coef``, ``ray.pools.trainer.bundles``)
    that a page writes is a key of the schema."""
    schema = _schema()
    sections = {k.split(".")[0] for k in schema if "." in k}
    text = (ROOT / page).read_text()
    named = set(re.findall(r"(?<![\w/.$-])([a-z_]+(?:\.[a-z_<>]+)+)(?=[\s`:=),/]|$)", text))
    missing = []
    for key in sorted(named - NOT_KEYS):
        if key.split(".")[0] not in sections or key.endswith(".*"):
            continue
        norm = re.sub(r"^ray\.pools\.[^.]+", "ray.pools.<name>", key)
        if norm not in schema:
            missing.append(key)
    assert not missing, f"{page} names keys the config does not have: {missing}"
