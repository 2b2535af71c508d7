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
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from relayrl.reward.math_forms import (
    mixed_numbers,
    number_from_words,
    split_interval,
    split_union,
    strip_variable_prefixes,
)
from relayrl.reward.verifiers import strip_special_tokens

__all__ = [
    "MathValue",
    "answers_equal",
    "extract_final_answer",
    "normalize_answer",
    "parse_answer",
    "verify_math",
]

MAX_ANSWER_CHARS = 400
MAX_DEPTH = 40
MAX_EXPONENT = 4096
MAX_BITS = 1 << 16
REL_TOL_DECIMAL = 1e-6
REL_TOL_EXACT = 1e-12

_MINUS = str.maketrans({"\u2212": "-", "\u2013": "-", "\ufe63": "-", "\uff0d": "-"})


class _ParseError(ValueError):
    pass


class _NotRational(Exception):
    pass


# ---------------------------------------------------------------------------------------------
# Extraction


def _balanced(text: str, start: int) -> tuple[str, int] | None:
    """Content of the brace group opening at ``text[start] == '{'`` and the index after it.

    Escaped braces (``\\{``, ``\\}``) do not count. None when unbalanced.
    """
    depth = 0
    i = start
    n = len(text)
    while i < n:
        c = text[i]
        if c == "\\" and i + 1 < n and text[i + 1] in "{}":
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i], i + 1
        i += 1
    return None


_BOXED_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])\s*")


def _last_boxed(text: str) -> str | None:
    last: str | None = None
    for m in _BOXED_RE.finditer(text):
        i = m.end()
        if i < len(text) and text[i] == "{":
            got = _balanced(text, i)
            if got is not None:
                last = got[0]
        else:
            mm = re.match(r"([^\s$]+)", text[i:])
            if mm:
                last = mm.group(1)
    return last


_ANSWER_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.S | re.I)
_ANSWER_IS_RE = re.compile(
    r"(?:final\s+answer|the\s+answer|answer)\s*(?:is\s*[:=]?|:|=)\s*([^\n]*)", re.I
)
_INLINE_MATH_RE = re.compile(r"\$\$(.+?)\$\$|\$(.+?)\$|\\\((.+?)\\\)|\\\[(.+?)\\\]", re.S)
_NUMBER_RE = re.compile(
    r"(?:(?<![0-9A-Za-z)\]}])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+)?"
    r"|(?:(?<![0-9A-Za-z)\]}])-)?\.\d+"
)


def extract_final_answer(text: Any) -> str | None:
    """The final answer of a completion as a string, or None when it holds none.

    See the module docstring for the rules. Never raises.
    """
    try:
        if not isinstance(text, str):
            return None
        text = strip_special_tokens(text.translate(_MINUS))
        boxed = _last_boxed(text)
        if boxed is not None and boxed.strip():
            return boxed.strip()
        tags = _ANSWER_TAG_RE.findall(text)
        if tags and tags[-1].strip():
            inner = tags[-1].strip()
            return _last_boxed(inner) or inner
        said = _ANSWER_IS_RE.findall(text)
        if said and said[-1].strip():
            return said[-1].strip()
        last_math = None
        for m in _INLINE_MATH_RE.finditer(text):
            body = next(g for g in m.groups() if g is not None)
            if body.strip():
                last_math = (m.end(), body.strip())
        last_num = None
        for m in _NUMBER_RE.finditer(text):
            last_num = (m.end(), m.group(0))
        if last_math and (last_num is None or last_math[0] >= last_num[0]):
            return last_math[1]
        if last_num:
            return last_num[1]
        return None
    except Exception:  # a verifier must never crash the reward path
        return None


# ---------------------------------------------------------------------------------------------
# Normalisation

_REMOVE = (
    "\\left",
    "\\right",
    "\\!",
    "\\,",
    "\\;",
    "\\:",
    "\\ ",
    "\\quad",
    "\\qquad",
    "\\displaystyle",
    "\\limits",
    "{,}",
)
_TEXT_CMD_RE = re.compile(r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mbox|operatorname)\s*")
_DEGREE_RE = re.compile(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|\\circ|\\degree|°")
_UNIT_TAIL_RE = re.compile(
    r"(?<=[0-9}).])\s*(?:[A-Za-z]{2,}\.?)(?:\s*(?:\^\s*\{?\d\}?|[A-Za-z]{2,}\.?|/))*\s*$"
)
_THOUSANDS_RE = re.compile(r"^[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_FUNCS = {
    "sin",
    "cos",
    "tan",
    "cot",
    "sec",
    "csc",
    "arcsin",
    "arccos",
    "arctan",
    "log",
    "ln",
    "exp",
}
_KNOWN_WORDS = {
    "sqrt",
    "pi",
    "inf",
    "infty",
    "infinity",
    "oo",
    "frac",
    "dfrac",
    "tfrac",
    "cdot",
    "times",
    "div",
} | _FUNCS


def _unwrap_text_commands(s: str) -> str:
    out = []
    i = 0
    while True:
        m = _TEXT_CMD_RE.search(s, i)
        if m is None:
            out.append(s[i:])
            return "".join(out)
        out.append(s[i : m.start()])
        j = m.end()
        if j < len(s) and s[j] == "{":
            got = _balanced(s, j)
            if got is None:
                out.append(s[j:])
                return "".join(out)
            out.append(" " + got[0] + " ")
            i = got[1]
        else:
            i = j


@dataclass
class _Normalized:
    text: str
    percent: bool


def _normalize(s: str) -> _Normalized:
    s = strip_special_tokens(s.translate(_MINUS)).strip()
    inner = _last_boxed(s)
    if inner is not None and inner.strip():
        s = inner
    s = s.replace("\\$", "").replace("$", "")
    s = re.sub(r"^\\\(|\\\)$|^\\\[|\\\]$", "", s.strip())
    for token in _REMOVE:
        s = s.replace(token, " " if token.startswith("\\q") else "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _DEGREE_RE.sub("", s)
    s = re.sub(r"[€£¥]", "", s)
    s = _unwrap_text_commands(s)
    s = s.replace("~", " ").strip()
    percent = False
    if s.endswith("\\%") or s.endswith("%"):
        percent = True
        s = s[:-2] if s.endswith("\\%") else s[:-1]
    s = s.strip().rstrip(".").strip()
    s = strip_variable_prefixes(s)  # "x = 1, x = 2" -> "1, 2"
    # "x = 5", "f(x)=2x+1": the right-hand side of the last '='
    if "=" in s and not re.search(r"[<>!]=|==", s):
        s = s.rsplit("=", 1)[1].strip()
    s = _UNIT_TAIL_RE.sub("", s).strip()
    if s.endswith("\\%") or s.endswith("%"):
        percent = True
        s = (s[:-2] if s.endswith("\\%") else s[:-1]).strip()
    compact = s.replace(" ", "")
    if _THOUSANDS_RE.match(compact):
        s = compact.replace(",", "")
    return _Normalized(mixed_numbers(s), percent)


def normalize_answer(s: str) -> str:
    """The normalised form of an answer string (what the parser sees)."""
    return _normalize(s).text


# ---------------------------------------------------------------------------------------------
# Tokenizer and parser (no eval: builds a small tree)

_TOKEN_RE = re.compile(
    r"\s*(?:"
    r"(?P<num>\d+(?:\.\d+)?[eE][+-]?\d+|\d+\.\d*|\.\d+|\d+)"
    r"|(?P<setopen>\\\{)|(?P<setclose>\\\})"
    r"|(?P<cmd>\\[A-Za-z]+)"
    r"|(?P<ident>[A-Za-z]+)"
    r"|(?P<op>\*\*|[-+*/^(),\[\]{}!×÷·√π∞])"
    r")"
)
_GREEK = {
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "theta",
    "lambda",
    "mu",
    "sigma",
    "phi",
    "omega",
    "tau",
    "rho",
    "eta",
    "zeta",
    "kappa",
    "nu",
    "xi",
    "psi",
    "chi",
}

Node = tuple


def _tokenize(s: str) -> list[tuple[str, str]]:
    tokens: list[tuple[str, str]] = []
    pos = 0
    s = s.rstrip()
    while pos < len(s):
        m = _TOKEN_RE.match(s, pos)
        if m is None or m.end() == pos:
            raise _ParseError(f"unexpected character {s[pos]!r}")
        kind = m.lastgroup or ""
        value = m.group(kind)
        pos = m.end()
        if kind == "op":
            value = {"**": "^", "×": "*", "÷": "/", "·": "*"}.get(value, value)
            if value == "√":
                kind, value = "cmd", "\\sqrt"
            elif value == "π":
                kind, value = "cmd", "\\pi"
            elif value == "∞":
                kind, value = "cmd", "\\infty"
        if kind == "cmd":
            name = value[1:]
            if name in ("cdot", "times", "ast"):
                kind, value = "op", "*"
            elif name == "div":
                kind, value = "op", "/"
        tokens.append((kind, value))
    return tokens


class _Parser:
    def __init__(self, tokens: list[tuple[str, str]]):
        self.toks = tokens
        self.i = 0
        self.depth = 0

    def peek(self) -> tuple[str, str] | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self) -> tuple[str, str]:
        tok = self.peek()
        if tok is None:
            raise _ParseError("unexpected end")
        self.i += 1
        return tok

    def expect(self, value: str) -> None:
        tok = self.take()
        if tok[1] != value:
            raise _ParseError(f"expected {value!r}, got {tok[1]!r}")

    def parse(self) -> Node:
        node = self.expr()
        if self.peek() is not None:
            raise _ParseError(f"trailing {self.peek()}")
        return node

    def expr(self) -> Node:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise _ParseError("nested too deeply")
        items = [self.sum()]
        while self.peek() == ("op", ","):
            self.take()
            items.append(self.sum())
        self.depth -= 1
        return items[0] if len(items) == 1 else ("tuple", tuple(items))

    def sum(self) -> Node:
        node = self.term()
        while self.peek() in (("op", "+"), ("op", "-")):
            op = self.take()[1]
            rhs = self.term()
            node = ("add", node, rhs if op == "+" else ("neg", rhs))
        return node

    def _starts_atom(self) -> bool:
        tok = self.peek()
        if tok is None:
            return False
        kind, value = tok
        if kind in ("num", "ident", "setopen"):
            return True
        if kind == "cmd":
            return True
        return value in ("(", "[", "{")

    def term(self) -> Node:
        node = self.unary()
        while True:
            tok = self.peek()
            if tok in (("op", "*"), ("op", "/")):
                op = self.take()[1]
                rhs = self.unary()
                node = ("mul", node, rhs) if op == "*" else ("div", node, rhs)
            elif self._starts_atom():
                node = ("mul", node, self.power())  # implicit multiplication: 2x, 3\sqrt{2}
            else:
                return node

    def unary(self) -> Node:
        tok = self.peek()
        if tok == ("op", "-"):
            self.take()
            return ("neg", self.unary())
        if tok == ("op", "+"):
            self.take()
            return self.unary()
        return self.power()

    def power(self) -> Node:
        base = self.postfix()
        if self.peek() == ("op", "^"):
            self.take()
            return ("pow", base, self.unary_group())
        return base

    def unary_group(self) -> Node:
        """An exponent: ``^{...}``, ``^2`` (one digit: ``x^23`` is x^2 * 3 in LaTeX), ``^-1``."""
        tok = self.peek()
        if tok is not None and tok[0] == "num" and len(tok[1]) > 1 and tok[1].isdigit():
            self.take()
            self.toks.insert(self.i, ("num", tok[1][1:]))
            return ("num", Fraction(int(tok[1][0])), False)
        if tok == ("op", "-"):
            self.take()
            return ("neg", self.unary_group())
        return self.postfix()

    def postfix(self) -> Node:
        node = self.atom()
        while self.peek() == ("op", "!"):
            self.take()
            node = ("fact", node)
        return node

    def group_arg(self) -> Node:
        """A LaTeX command argument: ``{expr}`` or a single character (``\\frac32``)."""
        tok = self.peek()
        if tok == ("op", "{"):
            self.take()
            node = self.expr()
            self.expect("}")
            return node
        if tok is not None and tok[0] == "num" and len(tok[1]) > 1 and tok[1].isdigit():
            self.take()
            self.toks.insert(self.i, ("num", tok[1][1:]))
            return ("num", Fraction(int(tok[1][0])), False)
        return self.atom()

    def atom(self) -> Node:
        kind, value = self.take()
        if kind == "num":
            mant, _, exp = value.lower().partition("e")
            frac = Fraction(mant)
            if exp:
                if abs(int(exp)) > MAX_EXPONENT:
                    raise _ParseError("exponent too large")
                frac *= Fraction(10) ** int(exp)
            # a decimal with a fractional part is compared with a tolerance: keep how many
            # decimal places it was written with (0: exact)
            places = len(mant.partition(".")[2]) if "." in mant else 0
            return ("num", frac, places if frac.denominator != 1 else 0)
        if kind == "setopen":
            items = [] if self.peek() == ("setclose", "\\}") else [self.sum()]
            while self.peek() == ("op", ","):
                self.take()
                items.append(self.sum())
            tok = self.take()
            if tok[0] != "setclose":
                raise _ParseError("unclosed set")
            return ("set", tuple(items))
        if kind == "op" and value in ("(", "[", "{"):
            close = {"(": ")", "[": "]", "{": "}"}[value]
            node = self.expr()
            self.expect(close)
            if node[0] == "tuple" and value == "{":
                return ("set", node[1])
            return node
        if kind == "ident":
            return self._ident(value)
        if kind == "cmd":
            return self._command(value[1:])
        raise _ParseError(f"unexpected {value!r}")

    def _ident(self, word: str) -> Node:
        low = word.lower()
        if low in ("pi",):
            return ("const", "pi")
        if low in ("inf", "infinity", "oo"):
            return ("const", "oo")
        if low == "sqrt":
            return ("sqrt", self.group_arg(), None)
        if low in _FUNCS:
            return ("func", low, self.group_arg())
        if len(word) == 1:
            return ("const", "e") if word == "e" else ("sym", word)
        if word in _GREEK:
            return ("sym", word)
        if len(word) <= 3 and word.isalpha() and word.islower():
            # "xy" -> x*y (implicit product of single-letter variables)
            node: Node = ("sym", word[0])
            for ch in word[1:]:
                node = ("mul", node, ("const", "e") if ch == "e" else ("sym", ch))
            return node
        raise _ParseError(f"word {word!r}")

    def _command(self, name: str) -> Node:
        if name == "frac" or name == "cfrac":
            num = self.group_arg()
            den = self.group_arg()
            return ("div", num, den)
        if name == "sqrt":
            index = None
            if self.peek() == ("op", "["):
                self.take()
                index = self.expr()
                self.expect("]")
            return ("sqrt", self.group_arg(), index)
        if name == "pi":
            return ("const", "pi")
        if name == "infty":
            return ("const", "oo")
        if name in _FUNCS:
            if self.peek() == ("op", "^"):  # \sin^2 x
                self.take()
                exp = self.unary_group()
                return ("pow", ("func", name, self.power()), exp)
            return ("func", name, self.power())
        if name in _GREEK:
            return ("sym", name)
        raise _ParseError(f"unknown command \\{name}")


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
            raise _ParseError("division by zero")
        return x / y, ax or ay
    if kind == "pow":
        x, ax = _rational(node[1])
        y, ay = _rational(node[2])
        if y.denominator != 1:
            raise _NotRational
        e = int(y)
        if abs(e) > MAX_EXPONENT:
            raise _ParseError("exponent too large")
        bits = max(x.numerator.bit_length(), x.denominator.bit_length()) * abs(e)
        if bits > MAX_BITS:
            raise _ParseError("number too large")
        if x == 0 and e < 0:
            raise _ParseError("division by zero")
        return x**e, ax or ay
    if kind == "fact":
        x, ax = _rational(node[1])
        if x.denominator != 1 or x < 0 or x > 500:
            raise _ParseError("bad factorial")
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
            raise _ParseError("division by zero")
        return _sympy(node[1]) / den
    if kind == "pow":
        base, exp = _sympy(node[1]), _sympy(node[2])
        if exp.is_number and (not exp.is_finite or abs(float(sympy.re(exp))) > MAX_EXPONENT):
            raise _ParseError("exponent too large")
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
            raise _ParseError("bad factorial")
        return sympy.factorial(arg)
    raise _ParseError(f"cannot build {kind}")


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
    norm = _normalize(s)
    text = norm.text
    if not text or len(text) > MAX_ANSWER_CHARS:
        return MathValue("text", _text_key(text), percent=norm.percent)
    try:
        special = _special_form(text)
        if special is not None:
            return special
        node = _Parser(_tokenize(text)).parse()
        return _value(node, norm.percent)
    except (_ParseError, ValueError, TypeError, ZeroDivisionError, OverflowError, RecursionError):
        return MathValue("text", _text_key(text), percent=norm.percent)


def _parse_math(text: str) -> MathValue:
    return _value(_Parser(_tokenize(text)).parse(), False)


def _special_form(text: str) -> MathValue | None:
    """Unions of intervals, intervals, and numbers in words (see ``math_forms``)."""
    parts = split_union(text)
    if parts is not None:
        return MathValue("union", tuple(_interval(p) for p in parts))
    if split_interval(text) is not None:
        try:
            return _interval(text)
        except (_ParseError, ValueError, TypeError, ZeroDivisionError, OverflowError):
            return None
    words = number_from_words(text)
    if words is not None:
        return MathValue("number", words)
    return None


def _interval(text: str) -> MathValue:
    got = split_interval(text)
    if got is None:
        raise _ParseError(f"not an interval: {text!r}")
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
