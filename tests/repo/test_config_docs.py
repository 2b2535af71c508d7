"""docs/config.md is generated from the config schema (``tools/config_docs.py``) and current:
every key of ``relayrl train`` / ``sft`` / ``rm`` has a row with its type, default, range and a
meaning, and the tool's fallback meanings name only keys that exist."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _tool():
    spec = importlib.util.spec_from_file_location("config_docs", ROOT / "tools" / "config_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_config_page_is_current() -> None:
    assert (ROOT / "docs" / "config.md").read_text() == _tool().render(), (
        "docs/config.md is stale: run `python tools/config_docs.py` and commit it"
    )


def test_every_key_has_a_row_with_a_meaning() -> None:
    from relayrl.config import RunConfig

    tool = _tool()
    keys = {key for key, *_ in tool.rows(RunConfig)}
    for key in ("seed", "algo.kl_coef", "async.eta", "model.lora.r", "ray.pools.<name>.bundles"):
        assert key in keys
    assert all(meaning for *_, meaning in tool.rows(RunConfig))


def test_fallback_meanings_name_real_fields() -> None:
    from relayrl.config import RunConfig, SFTConfig
    from relayrl.controller.rm_training import RMConfig

    tool = _tool()
    seen: set[str] = set()

    def walk(schema) -> None:
        for name, info in schema.model_fields.items():
            for cls in schema.__mro__:
                if name in getattr(cls, "__annotations__", {}):
                    seen.add(f"{cls.__name__}.{info.alias or name}")
            sub = tool._model_in(info.annotation)
            args = getattr(info.annotation, "__args__", ())
            for s in [sub, *(tool._model_in(a) for a in args)]:
                if s is not None:
                    walk(s)

    for schema in (RunConfig, SFTConfig, RMConfig):
        walk(schema)
    assert set(tool.MEANINGS) <= seen, sorted(set(tool.MEANINGS) - seen)


def test_a_key_without_a_meaning_is_an_error() -> None:
    from pydantic import BaseModel

    class Bare(BaseModel):
        undocumented: int = 1

    with pytest.raises(SystemExit, match="undocumented"):
        _tool().rows(Bare)
