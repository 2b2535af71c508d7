"""Reading a run config: YAML with line numbers, ``key=value`` overrides, one-line errors.

``relayrl.config`` re-exports ``load_config`` and ``dump_config``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from relayrl.config.base import ConfigError, KeyProblem

T = TypeVar("T", bound=BaseModel)


COMMAND_LINE = "command line"  # where an override's error is said to come from


def _dotted(loc: list[Any]) -> str:
    out = ""  # ['optim', 'betas', 0] -> optim.betas[0]
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "<root>"


def _yaml_line(node: yaml.Node | None, loc: list[Any]) -> int | None:
    """1-based line of the entry ``loc`` in a composed YAML document (None: not in it)."""
    line = None
    for part in loc:
        key: yaml.Node | None = None
        if isinstance(node, yaml.MappingNode):
            hits = [(k, v) for k, v in node.value if getattr(k, "value", None) == str(part)]
            key, node = hits[0] if hits else (None, None)
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int):
            key = node = node.value[part] if part < len(node.value) else None
        if key is None:
            return None
        line = key.start_mark.line + 1
    return line


def _format_error(
    err: ValidationError, path: str | None, doc: yaml.Node | None, cli_keys: list[str]
) -> str:
    """One line: where the key was set (``command line``: by an override, itself or a section
    above it; else ``file:line``), the key, its value and what is wrong."""
    first = err.errors()[0]
    loc: list[Any] = list(first["loc"])
    value, msg = first.get("input"), first["msg"]
    problem = first.get("ctx", {}).get("error")
    related: list[list[Any]] = []
    if isinstance(problem, KeyProblem):
        related = [loc + k.split(".") for k in problem.related]
        loc, value, msg = loc + problem.key.split("."), problem.value, problem.message
    elif first["type"] == "value_error":
        msg = msg.removeprefix("Value error, ")

    def from_cli(at: list[Any]) -> bool:
        base = ".".join(str(p) for p in at if not isinstance(p, int))
        return any(
            base == k or base.startswith(k + ".") or k.startswith(base + ".") for k in cli_keys
        )

    cli = path is None or from_cli(loc)
    line = None if cli else _yaml_line(doc, loc)
    where = COMMAND_LINE if cli or (line is None and any(map(from_cli, related))) else path
    where = f"{where}:{line}" if line is not None else where
    key = _dotted(loc)
    if first["type"] == "extra_forbidden":
        return f"{where}: unknown config key '{key}'"
    if first["type"] == "missing":
        return f"{where}: missing config key '{key}'"
    return f"{where}: bad value for '{key}' ({value!r}): {msg}"


def _parse_scalar(text: str) -> Any:
    """Parse an override value as YAML (so 0.05 is a float, true a bool, [a,b] a list)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides to a raw config dict (in place, returned)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form key=value")
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        node = raw
        for part in parts[:-1]:
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"override '{key}': '{part}' is not a section")
            node = nxt
        node[parts[-1]] = _parse_scalar(value)
    return raw


def _read_yaml(path: str) -> tuple[dict[str, Any], yaml.Node | None]:
    """The file's mapping and its composed node tree (for line numbers in errors)."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{path}: is a directory, not a config file")
    if not p.is_file():
        raise ConfigError(f"config file not found: {path}")
    text = p.read_text()
    try:
        loaded = yaml.safe_load(text)
        doc = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else path
        raise ConfigError(f"{where}: invalid YAML: {getattr(exc, 'problem', exc)}") from None
    if loaded is None:
        return {}, None
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: top level must be a mapping of config keys")
    return loaded, doc


def load_config(cls: type[T], path: str | Path | None, overrides: list[str] | None = None) -> T:
    """Read a YAML file (or nothing: defaults), apply overrides, validate into ``cls``; an
    invalid value is a ``ConfigError`` naming the key and its source (``_format_error``)."""
    raw, doc = _read_yaml(str(path)) if path is not None else ({}, None)
    overrides = overrides or []
    raw = apply_overrides(raw, overrides)
    try:
        return cls.model_validate(raw)
    except ValidationError as err:
        cli_keys = [item.split("=", 1)[0].strip() for item in overrides]
        source = None if path is None else str(path)
        raise ConfigError(_format_error(err, source, doc, cli_keys)) from None


def dump_config(cfg: BaseModel, path: str | Path) -> None:
    """Write a config back as YAML (the run directory keeps the exact config it ran with)."""
    Path(path).write_text(
        yaml.safe_dump(cfg.model_dump(mode="json", by_alias=True), sort_keys=False)
    )
