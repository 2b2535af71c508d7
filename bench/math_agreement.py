"""Agreement of math verifiers with the hand verdicts of ``tests/unit/reward/test_reward_math.py``.

Prints ONE JSON line: how many of the table's (completion, reference, verdict) rows each
verifier gets right -- relayrl's ``verify_math`` now (``after``), as of ``--before-ref``
(default ``main``, exported with ``git archive``), and HF ``math-verify`` when an interpreter
with it installed is given (``--math-verify-python``; it is not a project dependency), with
the rows each one misses.

    .venv/bin/python bench/math_agreement.py [--math-verify-python /tmp/mvenv/bin/python]
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
from pathlib import Path

from git_export import src_at

ROOT = Path(__file__).resolve().parents[1]
TABLE_FILE = ROOT / "tests" / "test_reward_math.py"

_RELAYRL = r"""
import json, sys
from relayrl.reward import verify_math
rows = json.load(sys.stdin)
print(json.dumps([verify_math(c, r) is e for c, r, e in rows]))
"""

_MATH_VERIFY = r"""
import json, sys
from math_verify import parse, verify
rows = json.load(sys.stdin)
out = []
for c, r, e in rows:
    try:
        gold = parse("$" + r + "$") or parse(r)
        got = bool(verify(gold, parse(c or ""))) if c else False
    except Exception:
        got = False
    out.append(got is e)
print(json.dumps(out))
"""


def table_rows() -> list[list]:
    """``TABLE + TABLE_ISSUE17`` of the test file (trusted: evaluated without the tests)."""
    tree = ast.parse(TABLE_FILE.read_text())
    ns: dict = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id.startswith("TABLE") for t in node.targets
        ):
            exec(compile(ast.Module([node], []), str(TABLE_FILE), "exec"), ns)  # noqa: S102
    return [list(r) for r in ns["TABLE"] + ns.get("TABLE_ISSUE17", [])]


def _run(python: str, code: str, rows: list, pythonpath: str | None) -> list[bool]:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    out = subprocess.run(
        [python, "-c", code],
        input=json.dumps(rows),
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    if out.returncode != 0:
        raise SystemExit(f"bench/math_agreement.py: {python} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before-ref", default="main")
    ap.add_argument("--math-verify-python", default=None)
    args = ap.parse_args()
    rows = table_rows()
    res: dict = {"rows": len(rows)}
    with src_at(args.before_ref, prefix="relayrl-math-before-") as before:
        verdicts = {
            "after": _run(sys.executable, _RELAYRL, rows, str(ROOT / "src")),
            "before": _run(sys.executable, _RELAYRL, rows, str(before)),
        }
    if args.math_verify_python:
        verdicts["math_verify"] = _run(args.math_verify_python, _MATH_VERIFY, rows, None)
    for name, ok in verdicts.items():
        res[name] = sum(ok)
        pairs = zip(rows, ok, strict=True)
        res[f"{name}_misses"] = [f"{r[0]!r} vs {r[1]!r}" for r, good in pairs if not good]
    print(json.dumps(res))


if __name__ == "__main__":
    main()
