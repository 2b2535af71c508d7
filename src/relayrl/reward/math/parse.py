"""The math verifier's tokenizer and recursive-descent parser: answer text to a small tree.

Nothing is ever ``eval``-ed (model output is untrusted): ``Parser(tokenize(s)).parse()``
builds nested tuples (``Node``) that ``relayrl.reward.math.answer`` evaluates as exact
rationals or sympy objects. Nesting depth (``MAX_DEPTH``) and literal exponents
(``MAX_EXPONENT``) are capped; anything the grammar does not accept raises ``ParseError``.
"""

from __future__ import annotations

import re
from fractions import Fraction

from relayrl.reward.math.extract import FUNCTIONS

__all__ = ["MAX_DEPTH", "MAX_EXPONENT", "Node", "ParseError", "Parser", "tokenize"]

MAX_DEPTH = 40
MAX_EXPONENT = 4096


class ParseError(ValueError):
    pass


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


def tokenize(s: str) -> list[tuple[str, str]]:
    tokens: list[tuple[str, str]] = []
    pos = 0
    s = s.rstrip()
    while pos < len(s):
        m = _TOKEN_RE.match(s, pos)
        if m is None or m.end() == pos:
            raise ParseError(f"unexpected character {s[pos]!r}")
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


class Parser:
    def __init__(self, tokens: list[tuple[str, str]]):
        self.toks = tokens
        self.i = 0
        self.depth = 0

    def peek(self) -> tuple[str, str] | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self) -> tuple[str, str]:
        tok = self.peek()
        if tok is None:
            raise ParseError("unexpected end")
        self.i += 1
        return tok

    def expect(self, value: str) -> None:
        tok = self.take()
        if tok[1] != value:
            raise ParseError(f"expected {value!r}, got {tok[1]!r}")

    def parse(self) -> Node:
        node = self.expr()
        if self.peek() is not None:
            raise ParseError(f"trailing {self.peek()}")
        return node

    def expr(self) -> Node:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise ParseError("nested too deeply")
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
                    raise ParseError("exponent too large")
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
                raise ParseError("unclosed set")
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
        raise ParseError(f"unexpected {value!r}")

    def _ident(self, word: str) -> Node:
        low = word.lower()
        if low in ("pi",):
            return ("const", "pi")
        if low in ("inf", "infinity", "oo"):
            return ("const", "oo")
        if low == "sqrt":
            return ("sqrt", self.group_arg(), None)
        if low in FUNCTIONS:
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
        raise ParseError(f"word {word!r}")

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
        if name in FUNCTIONS:
            if self.peek() == ("op", "^"):  # \sin^2 x
                self.take()
                exp = self.unary_group()
                return ("pow", ("func", name, self.power()), exp)
            return ("func", name, self.power())
        if name in _GREEK:
            return ("sym", name)
        raise ParseError(f"unknown command \\{name}")
