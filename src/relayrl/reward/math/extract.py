"""Math answers as text: extract a completion's final answer and normalise it for parsing.

Part of the math verifier (``relayrl.reward.math.answer`` has the rules and the public API);
this module holds its first two steps: ``extract_final_answer`` (boxed, ``<answer>``, "answer
is", the last inline math or number) and ``normalize`` / ``normalize_answer`` (``$``,
``\\left``, spacing, ``\\dfrac``, degrees, currency, ``\\text{}`` units, trailing words,
``x =`` prefixes, thousands separators, ``%``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from relayrl.reward.math.forms import mixed_numbers, strip_variable_prefixes
from relayrl.reward.verifiers import strip_special_tokens

__all__ = ["FUNCTIONS", "Normalized", "extract_final_answer", "normalize", "normalize_answer"]

_MINUS = str.maketrans({"\u2212": "-", "\u2013": "-", "\ufe63": "-", "\uff0d": "-"})


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
FUNCTIONS = {
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
} | FUNCTIONS


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
class Normalized:
    text: str
    percent: bool


def normalize(s: str) -> Normalized:
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
    return Normalized(mixed_numbers(s), percent)


def normalize_answer(s: str) -> str:
    """The normalised form of an answer string (what the parser sees)."""
    return normalize(s).text
