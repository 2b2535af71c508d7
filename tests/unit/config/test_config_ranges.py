"""Config ranges, generated from the schema: every constrained numeric key, given an
out-of-range value on the command line, exits 2 with one line naming the key as a
command-line value; every numeric key is constrained or on an explicit allow-list; the
cross-field checks name their key and where it was set (the file's line or the command line).

Validation runs before the model directory is checked (``cmd_train`` / ``cmd_sft``), so
the configs here point at a model that does not exist: a value that slipped through would
end in ``model directory not found`` instead of the expected message.
"""

from __future__ import annotations

import math
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Union, get_args, get_origin

import annotated_types as at
import pytest
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from relayrl.cli import main
from relayrl.config import ConfigError, RunConfig, SFTConfig, load_config

UNBOUNDED = {
    RunConfig: {
        "data.arithmetic.min_operand",  # negative operands are a feature ("(-3)+5=")
        "data.arithmetic.max_operand",  # checked against min_operand (cross-field)
        "reward.model_weight",  # any finite weight; negative makes the RM a penalty
        "reward.service.failure_score",
        "reward.service.functions[0].weight",
        "algo.entropy_coef",  # negative penalises entropy
    },
    SFTConfig: {"arithmetic.min_operand", "arithmetic.max_operand"},
}
"""Numeric keys without a range: each one a decision (floats must still be finite)."""

CUSTOM = {"threads": (0, "must be a whole number >= 1 or 'auto'")}
"""Keys validated by their own function: an out-of-range value and its message."""

PHRASE = {
    at.Ge: ("ge", "greater than or equal to"),
    at.Gt: ("gt", "greater than"),
    at.Le: ("le", "less than or equal to"),
    at.Lt: ("lt", "less than"),
}


@dataclass(frozen=True)
class NumericKey:
    key: str
    """As the error names it: ``optim.betas[0]``, ``ray.pools.main.bundles``."""
    kind: type
    bounds: tuple[Any, ...]
    """annotated_types Ge / Gt / Le / Lt objects."""
    custom: bool
    tuple_default: tuple[Any, ...] | None = None
    """For a tuple element: the whole default tuple (the override sets the whole tuple)."""


def _walk(key: str, ann: Any, meta: list[Any], default: Any) -> Iterator[NumericKey]:
    origin = get_origin(ann)
    if origin is Annotated:
        base, *extra = get_args(ann)
        for e in extra:
            meta = meta + (list(e.metadata) if isinstance(e, FieldInfo) else [e])
        yield from _walk(key, base, meta, default)
    elif origin in (Union, types.UnionType):
        for arg in get_args(ann):
            if arg is not type(None):
                yield from _walk(key, arg, meta, default)
    elif isinstance(ann, type) and issubclass(ann, BaseModel):
        yield from numeric_keys(ann, f"{key}.")
    elif origin is dict:
        yield from _walk(f"{key}.main", get_args(ann)[1], [], None)
    elif origin is list:
        yield from _walk(f"{key}[0]", get_args(ann)[0], [], None)
    elif origin is tuple:
        for i, arg in enumerate(get_args(ann)):
            for nk in _walk(f"{key}[{i}]", arg, list(meta), None):
                yield NumericKey(nk.key, nk.kind, nk.bounds, nk.custom, tuple(default))
    elif ann in (int, float):
        bounds = tuple(m for m in meta if type(m) in PHRASE)
        custom = any(type(m).__name__ == "PlainValidator" for m in meta)
        yield NumericKey(key, ann, bounds, custom)


def numeric_keys(model: type[BaseModel], prefix: str = "") -> Iterator[NumericKey]:
    """Every int / float key of ``model``, recursively (sections, pools, tuple elements)."""
    for name, info in model.model_fields.items():
        default = None if info.is_required() else info.get_default(call_default_factory=True)
        yield from _walk(f"{prefix}{info.alias or name}", info.annotation, info.metadata, default)


def _bad_values(nk: NumericKey) -> Iterator[tuple[Any, str]]:
    """An out-of-range value per bound (the boundary itself for strict bounds) and the
    message pydantic gives for it; NaN for every float."""
    for bound in nk.bounds:
        attr, phrase = PHRASE[type(bound)]
        limit = getattr(bound, attr)
        step = 1 if nk.kind is int else 0.5
        bad = {"ge": limit - step, "gt": limit, "le": limit + step, "lt": limit}[attr]
        yield bad, f"Input should be {phrase} {limit}"
    if nk.kind is float:
        yield math.nan, "Input should be a finite number"


def _cases(model: type[BaseModel]) -> list[Any]:
    cases = []
    for nk in numeric_keys(model):
        if "[0]." in nk.key:  # a list item's key: the list is set whole (none constrained)
            continue
        values = [CUSTOM[nk.key]] if nk.custom else list(_bad_values(nk))
        for bad, msg in values:
            cases.append(pytest.param(nk, bad, msg, id=f"{nk.key}={bad}"))
    return cases


def _override(nk: NumericKey, bad: Any) -> str:
    text = ".nan" if isinstance(bad, float) and math.isnan(bad) else str(bad)
    if nk.tuple_default is None:
        if nk.key.endswith("]"):  # a list whose default is null: a one-item list
            return f"{nk.key.split('[')[0]}=[{text}]"
        return f"{nk.key}={text}"
    base, index = nk.key[:-1].split("[")
    items = [str(v) for v in nk.tuple_default]
    items[int(index)] = text
    return f"{base}=[{', '.join(items)}]"


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict[type, Path]:
    root = tmp_path_factory.mktemp("cfg")
    (root / "run.yaml").write_text(f"model:\n  path: {root / 'no_model'}\n")
    (root / "sft.yaml").write_text(f"model_path: {root / 'no_model'}\n")
    return {RunConfig: root / "run.yaml", SFTConfig: root / "sft.yaml"}


def _fails_naming_key(capsys, command: str, cfg: Path, nk: NumericKey, bad: Any, msg: str):
    rc = main([command, str(cfg), _override(nk, bad)])
    err = capsys.readouterr().err.strip()
    shown = "nan" if isinstance(bad, float) and math.isnan(bad) else repr(bad)
    assert (rc, err) == (
        2,
        f"relayrl {command}: error: command line: bad value for '{nk.key}' ({shown}): {msg}",
    )


@pytest.mark.parametrize(("nk", "bad", "msg"), _cases(RunConfig))
def test_train_rejects_out_of_range_override(capsys, configs, nk, bad, msg):
    _fails_naming_key(capsys, "train", configs[RunConfig], nk, bad, msg)


@pytest.mark.parametrize(("nk", "bad", "msg"), _cases(SFTConfig))
def test_sft_rejects_out_of_range_override(capsys, configs, nk, bad, msg):
    _fails_naming_key(capsys, "sft", configs[SFTConfig], nk, bad, msg)


@pytest.mark.parametrize("model", [RunConfig, SFTConfig], ids=["RunConfig", "SFTConfig"])
def test_every_numeric_key_has_a_range_or_is_allowed_unbounded(model):
    keys = list(numeric_keys(model))
    unbounded = {nk.key for nk in keys if not nk.bounds and not nk.custom}
    assert unbounded == UNBOUNDED[model]
    assert {nk.key for nk in keys if nk.custom} == set(CUSTOM)
    if model is RunConfig:  # the walk reaches sections, tuple elements and pools
        assert {"algo.gamma", "optim.betas[1]", "ray.pools.main.bundles"} <= {n.key for n in keys}


# -- cross-field checks and where an error comes from -------------------------------------------


def _err(capsys, argv: list[str]) -> tuple[int, str]:
    rc = main(argv)
    return rc, capsys.readouterr().err.strip()


GRPO_ONE = (
    "bad value for 'algo.group_size' (1): the 'grpo' advantage needs >= 2 samples per prompt: "
    "it compares each sample with the others of its group, so with one every advantage is 0 "
    "(one sample per prompt: algo.name=ppo)"
)


def test_grpo_group_of_one_on_the_command_line_is_a_command_line_error(capsys, configs):
    rc, err = _err(capsys, ["train", str(configs[RunConfig]), "algo.group_size=1"])
    assert (rc, err) == (2, f"relayrl train: error: command line: {GRPO_ONE}")


def test_grpo_group_of_one_in_the_file_names_file_and_line(capsys, tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("seed: 1\nalgo:\n  name: grpo\n  group_size: 1\n")
    rc, err = _err(capsys, ["train", str(cfg)])
    assert (rc, err) == (2, f"relayrl train: error: {cfg}:4: {GRPO_ONE}")
    # the same key fixed on the command line: the file's other bad value is the file's
    cfg.write_text("algo:\n  group_size: 1\noptim:\n  betas: [0.9, 1.0]\n")
    rc, err = _err(capsys, ["train", str(cfg), "algo.group_size=4"])
    assert err == (
        f"relayrl train: error: {cfg}:4: bad value for 'optim.betas[1]' (1.0): "
        "Input should be less than 1"
    )


def test_group_advantage_under_ppo_needs_groups_but_gae_does_not():
    with pytest.raises(ConfigError) as info:
        load_config(RunConfig, None, ["algo.name=ppo", "algo.advantage=rloo", "algo.group_size=1"])
    assert str(info.value).startswith(
        "command line: bad value for 'algo.group_size' (1): the 'rloo' advantage needs >= 2"
    )
    assert load_config(RunConfig, None, ["algo.name=ppo", "algo.group_size=1"]).algo.group_size == 1


def test_betas_out_of_range_name_the_key(capsys, configs):
    rc, err = _err(capsys, ["train", str(configs[RunConfig]), "optim.betas=[1.5,2]"])
    assert (rc, err) == (
        2,
        "relayrl train: error: command line: bad value for 'optim.betas[0]' (1.5): "
        "Input should be less than 1",
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["algo.adaptive_kl_target=0.5"],  # kl_coef is its default 0
            "bad value for 'algo.kl_coef' (0.0): algo.adaptive_kl_target scales the KL "
            "coefficient multiplicatively from algo.kl_coef, so it must start > 0",
        ),
        (
            ["algo.prompts_per_step=2", "algo.group_size=2", "algo.mini_batches=5"],
            "bad value for 'algo.mini_batches' (5): more mini-batches than the 4 sequences of "
            "a step (algo.prompts_per_step * algo.group_size)",
        ),
        (
            ["algo.name=ppo", "algo.group_size=1", "data.dynamic_sampling.enabled=true"],
            "bad value for 'data.dynamic_sampling.enabled' (True): dynamic sampling drops groups "
            "whose outcomes are all equal, so it needs algo.group_size >= 2 (got 1: every group "
            "would be dropped)",
        ),
        (
            ["schedule=async", "reward.service.normalize=domain_zscore"],
            "bad value for 'reward.service.normalize' ('domain_zscore'): domain_zscore z-scores "
            "a step's batch at once, but schedule async scores each sample as it finishes, so "
            "the z-score would never be applied; use schedule: sync, or normalize: none",
        ),
        (
            ["data.arithmetic.min_operand=10", "data.arithmetic.max_operand=5"],
            "bad value for 'data.arithmetic.max_operand' (5): must be >= min_operand (10)",
        ),
        (
            ["algo.clip_eps_high=100"],
            "bad value for 'algo.clip_eps_high' (100): Input should be less than or equal to 10",
        ),
        (
            ["train.steps=0"],
            "bad value for 'train.steps' (0): Input should be greater than or equal to 1",
        ),
    ],
)
def test_cross_field_and_issue_values_name_the_key(capsys, configs, overrides, message):
    rc, err = _err(capsys, ["train", str(configs[RunConfig]), *overrides])
    assert (rc, err) == (2, f"relayrl train: error: command line: {message}")


def test_a_default_is_blamed_on_where_the_related_key_was_set(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("algo:\n  adaptive_kl_target: 0.5\n")
    message = (
        "bad value for 'algo.kl_coef' (0.0): algo.adaptive_kl_target scales the KL "
        "coefficient multiplicatively from algo.kl_coef, so it must start > 0"
    )
    with pytest.raises(ConfigError) as info:
        load_config(RunConfig, cfg)
    assert str(info.value) == f"{cfg}: {message}"
    cfg.write_text("algo:\n  name: ppo\n")
    with pytest.raises(ConfigError) as info:
        load_config(RunConfig, cfg, ["algo.adaptive_kl_target=0.5"])
    assert str(info.value) == f"command line: {message}"


def test_sft_target_pass_rate_needs_eval_every(capsys, configs):
    rc, err = _err(capsys, ["sft", str(configs[SFTConfig]), "target_pass_rate=0.5"])
    assert (rc, err) == (
        2,
        "relayrl sft: error: command line: bad value for 'target_pass_rate' (0.5): needs "
        "eval_every >= 1 (the pass rate is only measured every eval_every steps)",
    )


def test_shipped_configs_are_valid_and_jsonl_evaluates_on_held_out_data():
    root = Path(__file__).resolve().parents[3] / "configs"
    for path in sorted(root.glob("*.yaml")):
        if (
            path.name != "rlhf_rm.yaml"
        ):  # relayrl.controller.rm_training.RMConfig, tested with the RLHF code
            load_config(SFTConfig if path.name.startswith("sft") else RunConfig, path)
    data = load_config(RunConfig, root / "grpo_jsonl.yaml").data
    assert data.eval_path is None  # held out from data.train_path, not the bundled file


def test_group_advantages_are_the_estimators_that_take_groups():
    """The config's list (a leaf: it cannot import relayrl.algos) is the registry's."""
    import inspect

    from relayrl.algos.advantages import ADVANTAGE_ESTIMATORS
    from relayrl.config import GROUP_ADVANTAGES

    takes_groups = {
        name
        for name, fn in ADVANTAGE_ESTIMATORS.items()
        if "group_index" in inspect.signature(fn).parameters
    }
    assert takes_groups == GROUP_ADVANTAGES
