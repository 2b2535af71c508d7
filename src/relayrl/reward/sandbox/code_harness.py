"""Assert-style unit tests whose verdict the program under test cannot reach.

The program runs in its own sandboxed process and shares nothing with the code that decides
pass or fail. It is never shown a test: each ``assert`` is split, in this (trusted) process,
into *probes* -- the expressions rooted at a name the solution defines (``add(1, 2)``,
``Solution().two_sum([2, 7], 9)``) -- and the rest of the expression (``== 3``,
``abs(_ - 0.5) < 1e-9``, ``sorted(_) == [1, 2]``). The sandbox runs the solution, evaluates
only the probes and sends each value back, encoded as plain data, over a pipe on its own
descriptor. Here the values are decoded into plain Python values (numbers, strings, bytes,
lists, tuples, sets, dicts; anything else becomes an ``Opaque`` that equals nothing and is
false), put back into the expression, and the expression is evaluated with a small set of
builtins. So:

- no marker on stdout decides anything (a program may print anything, any amount);
- an object whose ``__eq__`` is always true never reaches a comparison: only its encoding
  does, and that decodes into a plain value or an ``Opaque``;
- rewriting the harness, ``exec``, ``print`` or the list of tests, exiting early, or writing
  forged lines on the channel gains nothing: the channel carries values the program could have
  computed itself, never a verdict, and the expected values never enter the sandbox;
- test indices are ours, not the program's: at most one verdict per test, in range.

A test must be made of ``assert`` statements (and ``import math``-style imports of the
modules in ``SAFE_MODULES``); solution names inside a comprehension or lambda cannot be
probed, and such a test fails with a reason saying so.
"""

from __future__ import annotations

import ast
import builtins
import json
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Opaque",
    "TestPlan",
    "decode_value",
    "harness_program",
    "judge",
    "plan_tests",
]

SAFE_BUILTINS = (
    "abs all any bool bytes chr complex dict divmod enumerate filter float frozenset hash int "
    "isinstance issubclass len list map max min ord pow range repr reversed round set slice "
    "sorted str sum tuple type zip True False None ValueError TypeError Exception"
).split()
SAFE_MODULES = ("math", "cmath", "string")
MAX_VALUE_BYTES = 1 << 20  # one probe's encoded value
MAX_DEPTH = 64


class UnsupportedTest(ValueError):
    """A test the harness cannot split into probes and a trusted check."""


class Opaque:
    """A value the sandbox reported that is not plain data: it equals nothing, is false,
    and supports no arithmetic, so a forged object can never satisfy a check."""

    __slots__ = ("type_name",)

    def __init__(self, type_name: str) -> None:
        self.type_name = type_name

    def __eq__(self, other: object) -> bool:
        return False

    def __ne__(self, other: object) -> bool:
        return True

    def __bool__(self) -> bool:
        return False

    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return f"<opaque {self.type_name}>"


@dataclass
class TestPlan:
    """One test: its checks (expressions over ``_p<k>`` names) and the probes they need."""

    index: int
    checks: list[ast.Expression] = field(default_factory=list)
    probes: list[str] = field(default_factory=list)  # source of each probe, in order
    first_probe: int = 0  # global number of this test's first probe
    namespace: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # why the test cannot be judged (fails with this reason)


def _bound_names(tree: ast.AST) -> set[str]:
    """Names bound inside an expression (comprehension targets, lambda arguments, :=)."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.comprehension):
            out |= {n.id for n in ast.walk(node.target) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.Lambda):
            a = node.args
            out |= {x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs]}
            out |= {x.arg for x in (a.vararg, a.kwarg) if x is not None}
        elif isinstance(node, ast.NamedExpr):
            out.add(node.target.id)
    return out


def _chain_root(node: ast.expr) -> ast.expr:
    while isinstance(node, (ast.Call, ast.Attribute, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node


class _Splitter(ast.NodeTransformer):
    """Replaces each expression rooted at a solution name by ``_p<k>`` and records it."""

    def __init__(self, known: set[str], bound: set[str], start: int) -> None:
        self.known, self.bound, self.next = known, bound, start
        self.probes: list[str] = []

    def _solution_name(self, name: str) -> bool:
        return name not in self.known and name not in self.bound

    def visit(self, node: ast.AST) -> ast.AST:
        if isinstance(node, ast.expr) and not isinstance(node, ast.Starred):
            root = _chain_root(node)
            if isinstance(root, ast.Name) and self._solution_name(root.id):
                used = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
                if used & self.bound:
                    raise UnsupportedTest(
                        "solution names inside a comprehension or lambda cannot be probed"
                    )
                self.probes.append(ast.unparse(node))
                name = ast.Name(id=f"_p{self.next}", ctx=ast.Load())
                self.next += 1
                return ast.copy_location(name, node)
        return self.generic_visit(node)


def _namespace() -> dict[str, Any]:
    ns: dict[str, Any] = {n: getattr(builtins, n) for n in SAFE_BUILTINS}
    return {"__builtins__": ns}


def _plan_one(index: int, source: str, start: int) -> TestPlan:
    plan = TestPlan(index=index, first_probe=start, namespace=_namespace())
    try:
        tree = ast.parse(source, f"test_{index}.py")
    except SyntaxError as exc:
        plan.error = f"test {index} is not valid Python: {exc.msg} (line {exc.lineno})"
        return plan
    known = set(SAFE_BUILTINS)
    try:
        for stmt in tree.body:
            if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                mod = stmt.module if isinstance(stmt, ast.ImportFrom) else None
                for alias in stmt.names:
                    top = mod or alias.name
                    if top not in SAFE_MODULES or alias.name == "*":
                        raise UnsupportedTest(
                            f"line {stmt.lineno}: import of {top!r} (only "
                            f"{', '.join(SAFE_MODULES)} may be imported)"
                        )
                    module = __import__(top)
                    value = getattr(module, alias.name) if mod else module
                    local = alias.asname or alias.name
                    plan.namespace[local] = value
                    known.add(local)
                continue
            if not isinstance(stmt, ast.Assert):
                raise UnsupportedTest(
                    f"line {stmt.lineno}: {type(stmt).__name__} statement (only assert "
                    "statements and imports are allowed)"
                )
            splitter = _Splitter(known, _bound_names(stmt.test), start + len(plan.probes))
            expr = splitter.visit(stmt.test)
            plan.probes += splitter.probes
            body = ast.fix_missing_locations(ast.Expression(body=expr))  # type: ignore[arg-type]
            plan.checks.append(body)
    except UnsupportedTest as exc:
        plan.error = f"test {index} is not supported by the harness: {exc}"
        plan.checks, plan.probes = [], []
    return plan


def plan_tests(tests: list[str]) -> list[TestPlan]:
    """Split every test into probes (run in the sandbox) and checks (run here)."""
    plans, start = [], 0
    for i, src in enumerate(tests):
        plan = _plan_one(i, src, start)
        start += len(plan.probes)
        plans.append(plan)
    return plans


# ---------------------------------------------------------------------------------------------
# the program that runs in the sandbox (untrusted once the solution has run; it only evaluates)

_PROGRAM = """\
import json as _json, math as _math, os as _os
_out = _os.fdopen(3, "w", encoding="utf-8")
_probes = {probes!r}


def _enc(v, d=0):
    t = type(v)
    if d > {depth}:
        return {{"t": "other", "type": "deep"}}
    if v is None:
        return {{"t": "none"}}
    if t is bool:
        return {{"t": "bool", "v": v}}
    if t is int:
        return {{"t": "int", "v": str(v)}}
    if t is float:
        return {{"t": "float", "v": repr(v)}}
    if t is complex:
        return {{"t": "complex", "v": [repr(v.real), repr(v.imag)]}}
    if t is str:
        return {{"t": "str", "v": v}}
    if t is bytes:
        return {{"t": "bytes", "v": v.hex()}}
    if t in (list, tuple, set, frozenset):
        return {{"t": t.__name__, "v": [_enc(x, d + 1) for x in v]}}
    if t is dict:
        return {{"t": "dict", "v": [[_enc(k, d + 1), _enc(x, d + 1)] for k, x in v.items()]}}
    return {{"t": "other", "type": t.__qualname__}}


_g = {{"__name__": "__solution__"}}
try:
    with open("solution.py", encoding="utf-8") as _f:
        exec(compile(_f.read(), "solution.py", "exec"), _g)
except BaseException as _e:
    _out.write(_json.dumps({{"load": type(_e).__name__}}) + "\\n")
    _out.flush()
    raise SystemExit(1)
for _m in {modules!r}:
    _g.setdefault(_m, __import__(_m))
for _k, _src in enumerate(_probes):
    try:
        _msg = {{"k": _k, "v": _enc(eval(compile(_src, "test.py", "eval"), _g))}}
    except BaseException as _e:
        _msg = {{"k": _k, "err": type(_e).__name__}}
    try:
        _line = _json.dumps(_msg)
    except BaseException as _e:
        _line = _json.dumps({{"k": _k, "err": type(_e).__name__}})
    _out.write(_line + "\\n")
    _out.flush()
"""


def harness_program(plans: list[TestPlan]) -> str:
    """The sandbox's ``main.py``: runs ``solution.py``, then sends each probe's value on fd 3."""
    probes = [p for plan in plans for p in plan.probes]
    return _PROGRAM.format(probes=probes, depth=MAX_DEPTH, modules=SAFE_MODULES)


# ---------------------------------------------------------------------------------------------
# decoding and judging (trusted)


def decode_value(obj: Any, depth: int = 0) -> Any:
    """A plain Python value from the sandbox's encoding; ``Opaque`` for anything else."""
    if depth > MAX_DEPTH or not isinstance(obj, dict):
        return Opaque("malformed")
    t, v = obj.get("t"), obj.get("v")
    try:
        if t == "none":
            return None
        if t == "bool" and isinstance(v, bool):
            return v
        if t == "int" and isinstance(v, str):
            return int(v)
        if t == "float" and isinstance(v, str):
            return float(v)
        if t == "complex" and isinstance(v, list) and len(v) == 2:
            return complex(float(v[0]), float(v[1]))
        if t == "str" and isinstance(v, str):
            return v
        if t == "bytes" and isinstance(v, str):
            return bytes.fromhex(v)
        if t in ("list", "tuple", "set", "frozenset") and isinstance(v, list):
            items = [decode_value(x, depth + 1) for x in v]
            return {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}[t](items)
        if t == "dict" and isinstance(v, list):
            pairs = [
                (decode_value(p[0], depth + 1), decode_value(p[1], depth + 1))
                for p in v
                if isinstance(p, list) and len(p) == 2
            ]
            return dict(pairs)
    except (ValueError, TypeError, OverflowError, RecursionError):
        return Opaque("malformed")
    name = obj.get("type")
    return Opaque(name if isinstance(name, str) else "unknown")


def _read_channel(data: bytes, n_probes: int) -> tuple[dict[int, Any], str | None]:
    """Probe number -> decoded value (or an ``Exception`` name), and a load error if any.

    Only the first report of each probe number counts; numbers out of range are ignored."""
    values: dict[int, Any] = {}
    load: str | None = None
    for raw in data.split(b"\n"):
        if not raw or len(raw) > MAX_VALUE_BYTES:
            continue
        try:
            msg = json.loads(raw)
        except (ValueError, RecursionError):
            continue
        if not isinstance(msg, dict):
            continue
        if "load" in msg and load is None and not values:
            load = str(msg["load"])[:100]
            continue
        k = msg.get("k")
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k < n_probes:
            continue
        if k in values:
            continue
        if "err" in msg:
            values[k] = _Raised(str(msg["err"])[:100])
        else:
            values[k] = decode_value(msg.get("v"))
    return values, load


@dataclass(frozen=True)
class _Raised:
    name: str


def judge(plans: list[TestPlan], channel: bytes) -> tuple[list[bool], list[str | None]]:
    """Per test: passed?, and why not. Every check is evaluated here, on decoded values."""
    n_probes = sum(len(p.probes) for p in plans)
    values, load = _read_channel(channel, n_probes)
    passed: list[bool] = []
    reasons: list[str | None] = []
    for plan in plans:
        ok, why = _judge_one(plan, values, load)
        passed.append(ok)
        reasons.append(why)
    return passed, reasons


def _judge_one(plan: TestPlan, values: dict[int, Any], load: str | None) -> tuple[bool, str | None]:
    if plan.error is not None:
        return False, plan.error
    if load is not None:
        return False, f"solution failed to load: {load}"
    ns = dict(plan.namespace)
    for j in range(len(plan.probes)):
        k = plan.first_probe + j
        if k not in values:
            return False, f"test {plan.index} did not complete"
        v = values[k]
        if isinstance(v, _Raised):
            return False, f"test {plan.index} failed: {v.name}"
        ns[f"_p{k}"] = v
    for check in plan.checks:
        try:
            ok = eval(compile(check, f"test_{plan.index}.py", "eval"), ns)  # noqa: S307
        except Exception as exc:  # a check on plain values: the test's own error
            return False, f"test {plan.index} failed: {type(exc).__name__}"
        if not ok:  # plain values (or Opaque, which is false) only: bool() is ours
            return False, f"test {plan.index} failed: AssertionError"
    return True, None
