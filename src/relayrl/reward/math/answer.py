"""Math answer verification: extract a completion's final answer, compare it with the reference.

Extraction (``extract_final_answer``), first rule that matches wins:

1. the last ``\\boxed{...}`` / ``\\fbox{...}`` (balanced braces; ``\\boxed 5`` too);
2. the last ``<answer>...</answer>`` block;
3. the text after the last "answer is" / "answer:" (up to the end of its line);
4. whichever comes later in the text: the last inline-math span (``$...$``, ``\\(...\\)``)
   or the last number (integers, decimals, ``a/b``, ``1,000``; a ``-`` right after a
   digit or letter is an operator, not a sign).

Comparison (``answers_equal``): both sides are normalised (``$``, ``\\left``, spacing
commands, ``\\dfrac``, degrees, currency, ``\\text{}`` units, trailing words such as
``cm``, ``x = `` prefixes, thousands separators, ``%``) and parsed by a small
recursive-descent parser into an expression tree. Nothing is ever ``eval``-ed: model output
is untrusted. Then

- exact rationals compare exactly (``0.5 == 1/2``; ``10^{3} == 1000``); a side written as a
  decimal with a fractional part compares with relative tolerance ``1e-6``
  (``0.3333333 == 1/3``, ``0.333 != 1/3``);
- expressions with radicals, ``pi``, functions or variables are built as sympy objects and
  compared numerically at high precision (constants) or at seeded random points (with
  variables): ``2\\sqrt{2} == \\sqrt{8}``, ``x^2+2x+1 == (x+1)^2``;
- tuples compare in order, sets ``\\{...\\}`` in any order; ``50\\%`` equals ``50`` and ``0.5``;
- answers that do not parse as math compare as normalised text (case-insensitive).

Sizes are capped (input length, nesting depth, exponents, factorials) so adversarial strings
cannot hang the verifier. ``verify_math`` never raises.

Extraction and normalisation are ``extract``, the tokenizer and parser ``parse``,
the forms the parser alone gets wrong (intervals, mixed numbers, numbers in words)
``forms``; this module evaluates the trees and compares.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from relayrl.reward.math.extract import extract_final_answer, normalize, normalize_answer
from relayrl.reward.math.forms import number_from_words, split_interval, split_union
from relayrl.reward.math.parse import MAX_EXPONENT, Node, ParseError, Parser, tokenize

__all__ = [
    "MathValue",
    "answers_equal",
    "extract_final_answer",
    "normalize_answer",
    "parse_answer",
    "verify_math",
]

MAX_ANSWER_CHARS = 400
MAX_BITS = 1 << 16
REL_TOL_DECIMAL = 1e-6
REL_TOL_EXACT = 1e-12


class _NotRational(Exception):
    pass


# ---------------------------------------------------------------------------------------------
# Values


@dataclass(frozen=True)
class MathValue:
    """A parsed answer: ``kind`` is ``"number"`` (exact ``Fraction``; ``approx`` when
    written with decimals), ``"expr"`` (a sympy expression), ``"tuple"``, ``"set"`` or
    ``"text"``, ``"interval"`` (``(left, low, high, right)``) or ``"union"``. ``percent``
    is set when the answer ended with ``%``."""

    kind: str
    value: Any
    approx: bool = False
    percent: bool = False
    places: int = 0  # decimal places of a literal decimal (its precision); 0: exact/unknown


def _rational(node: Node) -> tuple[Fraction, bool]:
    """Exact value of a tree of rationals, or _NotRational. Returns (value, approx)."""
    kind = node[0]
    if kind == "num":
        return node[1], bool(node[2])
    if kind == "neg":
        v, a = _rational(node[1])
        return -v, a
    if kind in ("add", "mul", "div"):
        x, ax = _rational(node[1])
        y, ay = _rational(node[2])
        if kind == "add":
            return x + y, ax or ay
        if kind == "mul":
            return x * y, ax or ay
        if y == 0:
            raise ParseError("division by zero")
        return x / y, ax or ay
    if kind == "pow":
        x, ax = _rational(node[1])
        y, ay = _rational(node[2])
        if y.denominator != 1:
            raise _NotRational
        e = int(y)
        if abs(e) > MAX_EXPONENT:
            raise ParseError("exponent too large")
        bits = max(x.numerator.bit_length(), x.denominator.bit_length()) * abs(e)
        if bits > MAX_BITS:
            raise ParseError("number too large")
        if x == 0 and e < 0:
            raise ParseError("division by zero")
        return x**e, ax or ay
    if kind == "fact":
        x, ax = _rational(node[1])
        if x.denominator != 1 or x < 0 or x > 500:
            raise ParseError("bad factorial")
        return Fraction(math.factorial(int(x))), ax
    raise _NotRational


def _sympy(node: Node) -> Any:
    import sympy

    kind = node[0]
    if kind == "num":
        return sympy.Rational(node[1].numerator, node[1].denominator)
    if kind == "sym":
        return sympy.Symbol(node[1])
    if kind == "const":
        return {"pi": sympy.pi, "e": sympy.E, "oo": sympy.oo}[node[1]]
    if kind == "neg":
        return -_sympy(node[1])
    if kind == "add":
        return _sympy(node[1]) + _sympy(node[2])
    if kind == "mul":
        return _sympy(node[1]) * _sympy(node[2])
    if kind == "div":
        den = _sympy(node[2])
        if den == 0:
            raise ParseError("division by zero")
        return _sympy(node[1]) / den
    if kind == "pow":
        base, exp = _sympy(node[1]), _sympy(node[2])
        if exp.is_number and (not exp.is_finite or abs(float(sympy.re(exp))) > MAX_EXPONENT):
            raise ParseError("exponent too large")
        return base**exp
    if kind == "sqrt":
        arg = _sympy(node[1])
        if node[2] is None:
            return sympy.sqrt(arg)
        return sympy.root(arg, _sympy(node[2]))
    if kind == "func":
        fn = {
            "sin": sympy.sin,
            "cos": sympy.cos,
            "tan": sympy.tan,
            "cot": sympy.cot,
            "sec": sympy.sec,
            "csc": sympy.csc,
            "arcsin": sympy.asin,
            "arccos": sympy.acos,
            "arctan": sympy.atan,
            "log": sympy.log,
            "ln": sympy.log,
            "exp": sympy.exp,
        }[node[1]]
        return fn(_sympy(node[2]))
    if kind == "fact":
        arg = _sympy(node[1])
        if arg.is_number and (not arg.is_integer or arg < 0 or arg > 500):
            raise ParseError("bad factorial")
        return sympy.factorial(arg)
    raise ParseError(f"cannot build {kind}")


def _places(node: Node) -> int:
    if node[0] == "neg":
        return _places(node[1])
    return int(node[2]) if node[0] == "num" else 0


def _value(node: Node, percent: bool) -> MathValue:
    if node[0] in ("tuple", "set"):
        return MathValue(node[0], tuple(_value(n, False) for n in node[1]), percent=percent)
    try:
        v, approx = _rational(node)
        return MathValue("number", v, approx, percent, _places(node))
    except _NotRational:
        return MathValue("expr", _sympy(node), _has_approx(node), percent)


def _has_approx(node: Node) -> bool:
    if node[0] == "num":
        return bool(node[2])
    return any(isinstance(c, tuple) and _has_approx(c) for c in node[1:])


def _text_key(s: str) -> str:
    s = s.replace("\\", " ").replace("{", " ").replace("}", " ")
    return " ".join(s.casefold().split()).strip(" .")


def parse_answer(s: str) -> MathValue:
    """Normalise and parse an answer string into a ``MathValue`` (``"text"`` when it is not
    math). Raises nothing for bad input: an empty or unparsable answer is text."""
    if not isinstance(s, str):
        return MathValue("text", "")
    s = s[: MAX_ANSWER_CHARS * 2]
    norm = normalize(s)
    text = norm.text
    if not text or len(text) > MAX_ANSWER_CHARS:
        return MathValue("text", _text_key(text), percent=norm.percent)
    try:
        special = _special_form(text)
        if special is not None:
            return special
        node = Parser(tokenize(text)).parse()
        return _value(node, norm.percent)
    except (ParseError, ValueError, TypeError, ZeroDivisionError, OverflowError, RecursionError):
        return MathValue("text", _text_key(text), percent=norm.percent)


def _parse_math(text: str) -> MathValue:
    return _value(Parser(tokenize(text)).parse(), False)


def _special_form(text: str) -> MathValue | None:
    """Unions of intervals, intervals, and numbers in words (see ``forms``)."""
    parts = split_union(text)
    if parts is not None:
        return MathValue("union", tuple(_interval(p) for p in parts))
    if split_interval(text) is not None:
        try:
            return _interval(text)
        except (ParseError, ValueError, TypeError, ZeroDivisionError, OverflowError):
            return None
    words = number_from_words(text)
    if words is not None:
        return MathValue("number", words)
    return None


def _interval(text: str) -> MathValue:
    got = split_interval(text)
    if got is None:
        raise ParseError(f"not an interval: {text!r}")
    left, lo, hi, right = got
    return MathValue("interval", (left, _parse_math(lo), _parse_math(hi), right))


# ---------------------------------------------------------------------------------------------
# Comparison


def _close(x: complex, y: complex, rel: float) -> bool:
    if x == y:
        return True
    if not (math.isfinite(abs(x)) and math.isfinite(abs(y))):
        return False
    return abs(x - y) <= rel * max(1.0, abs(x), abs(y))


def _numeric(expr: Any, subs: dict | None = None) -> complex | None:
    import sympy

    try:
        v = expr.evalf(30, subs=subs) if subs else expr.evalf(30)
        if v in (sympy.oo, -sympy.oo, sympy.zoo) or v.has(sympy.nan):
            return None
        if v.free_symbols:
            return None
        return complex(v)
    except (TypeError, ValueError, ArithmeticError, AttributeError):
        return None


def _half_unit(a: MathValue, b: MathValue) -> float | None:
    """Half a unit in the last written place of the coarser literal decimal: a decimal
    stands for the numbers that round to it (1234567.5 is not 1234567)."""
    places = [v.places for v in (a, b) if v.places > 0]
    return 0.5 * 10.0 ** -min(places) if places else None


def _scalars_equal(a: MathValue, b: MathValue) -> bool:
    rel = REL_TOL_DECIMAL if (a.approx or b.approx) else REL_TOL_EXACT
    if a.kind == "number" and b.kind == "number":
        if a.value == b.value:
            return True
        if not (a.approx or b.approx):
            return False
        half = _half_unit(a, b)
        if half is not None and abs(a.value - b.value) > Fraction(half) * (1 + 1e-9):
            return False
        return _close(float(a.value), float(b.value), rel)
    import sympy

    x = a.value if a.kind == "expr" else sympy.Rational(a.value.numerator, a.value.denominator)
    y = b.value if b.kind == "expr" else sympy.Rational(b.value.numerator, b.value.denominator)
    try:
        if x == y:
            return True
    except Exception:
        pass
    symbols = sorted(getattr(x, "free_symbols", set()) | getattr(y, "free_symbols", set()), key=str)
    if not symbols:
        vx, vy = _numeric(x), _numeric(y)
        return vx is not None and vy is not None and _close(vx, vy, max(rel, 1e-12))
    rng = random.Random(0)
    checked = 0
    for _ in range(12):
        subs = {s: sympy.Float(rng.uniform(0.5, 2.5), 30) for s in symbols}
        vx, vy = _numeric(x, subs), _numeric(y, subs)
        if vx is None or vy is None:
            continue
        if not _close(vx, vy, max(rel, 1e-9)):
            return False
        checked += 1
        if checked >= 4:
            return True
    return False


def _as_pair(v: MathValue) -> MathValue:
    """An open interval ``(a, b)`` doubles as the point / pair ``a, b``."""
    if v.kind == "interval" and v.value[0] == "(" and v.value[3] == ")":
        return MathValue("tuple", (v.value[1], v.value[2]))
    return v


def _same_items(xs: tuple, ys: tuple, unordered: bool) -> bool:
    left = list(ys)
    for x in xs:
        for j, y in enumerate(left):
            if _equal(x, y, unordered):
                del left[j]
                break
        else:
            return False
    return True


def _equal(a: MathValue, b: MathValue, unordered: bool = False) -> bool:
    if a.kind == "text" or b.kind == "text":
        return a.kind == b.kind == "text" and a.value != "" and a.value == b.value
    if a.kind == b.kind == "interval":
        (la, loa, hia, ra), (lb, lob, hib, rb) = a.value, b.value
        return la == lb and ra == rb and _equal(loa, lob) and _equal(hia, hib)
    if a.kind == b.kind == "union":
        return len(a.value) == len(b.value) and _same_items(a.value, b.value, False)
    if "interval" in (a.kind, b.kind):
        a, b = _as_pair(a), _as_pair(b)
        if "interval" in (a.kind, b.kind):
            return False
    if a.kind in ("tuple", "set", "union") or b.kind in ("tuple", "set", "union"):
        if a.kind != b.kind or len(a.value) != len(b.value):
            return False
        if a.kind == "tuple" and not unordered:
            return all(_equal(x, y) for x, y in zip(a.value, b.value, strict=True))
        return _same_items(a.value, b.value, unordered)
    return _scalars_equal(a, b)


def _candidates(v: MathValue) -> list[MathValue]:
    """``50%`` stands for both 50 and 0.5."""
    if not v.percent or v.kind not in ("number", "expr"):
        return [v]
    scaled = v.value / 100
    return [v, MathValue(v.kind, scaled, v.approx, False)]


def answers_equal(predicted: str, reference: str, unordered: bool = False) -> bool:
    """True when two answer strings denote the same mathematical object. Never raises.

    ``unordered``: lists (``1, 2, 3``, ``(1, 2, 3)``) compare as multisets (the task says the
    order does not matter)."""
    try:
        a, b = parse_answer(predicted), parse_answer(reference)
        return any(_equal(x, y, unordered) for x in _candidates(a) for y in _candidates(b))
    except Exception:
        return False


def verify_math(completion: Any, reference: Any, unordered: bool = False) -> bool:
    """True when the final answer of ``completion`` equals ``reference``. Never raises.

    ``reference`` may be a string or a number (a ``\\boxed{}`` inside it is unwrapped).
    The final answer is the *last* ``\\boxed{}`` when there are several. ``unordered``: see
    ``answers_equal``.
    """
    try:
        if reference is None or isinstance(reference, bool):
            return False
        if isinstance(reference, (int, float)):
            if isinstance(reference, float) and not math.isfinite(reference):
                return False
            reference = repr(reference) if isinstance(reference, float) else str(reference)
        if not isinstance(reference, str) or not reference.strip():
            return False
        answer = extract_final_answer(completion)
        if answer is None:
            return False
        return answers_equal(answer, reference, unordered)
    except Exception:
        return False
