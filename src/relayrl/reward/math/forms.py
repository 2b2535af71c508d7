"""Answer forms the expression parser alone gets wrong (``relayrl.reward.math.answer``).

- mixed numbers: ``2\\frac{1}{2}`` and ``2 1/2`` are 5/2, not 2 * 1/2 (``mixed_numbers``
  rewrites them to ``(2+\\frac{1}{2})`` before parsing);
- intervals: ``[2, 5)``, ``(-\\infty, 3]``, unions with ``\\cup``: the bracket types count,
  so ``(2,5) != [2,5]`` (``split_interval``); two-element pairs are read this way, which
  compares points ``(1, 2)`` the same as before;
- several "x = 1, x = 2" / "x = 1 or x = 2" answers become a list ``1, 2``
  (``strip_variable_prefixes``);
- answers in words: ``five``, ``twenty-one``, ``one hundred and five``, ``one half``,
  ``three quarters`` (``number_from_words``).

Only the standard library; nothing is ever ``eval``-ed.
"""

from __future__ import annotations

import re
from fractions import Fraction

__all__ = [
    "mixed_numbers",
    "number_from_words",
    "split_interval",
    "split_union",
    "strip_variable_prefixes",
]

_MIXED_LATEX_RE = re.compile(
    r"(?<![\w.^_}\)\]])(\d+)\s*\\frac\s*\{\s*(\d+)\s*\}\s*\{\s*(\d+)\s*\}(?![\w{(\\^])"
)
_MIXED_PLAIN_RE = re.compile(r"^\s*(-?)(\d+)\s+(\d+)\s*/\s*(\d+)\s*$")


def mixed_numbers(s: str) -> str:
    """``2\\frac{1}{2}`` -> ``(2+\\frac{1}{2})`` (a proper fraction after an integer), and a
    whole answer ``2 1/2`` -> ``(2+1/2)``; anything else unchanged."""

    def latex(m: re.Match[str]) -> str:
        whole, num, den = m.group(1), int(m.group(2)), int(m.group(3))
        if den == 0 or num >= den:
            return m.group(0)
        return f"({whole}+\\frac{{{num}}}{{{den}}})"

    s = _MIXED_LATEX_RE.sub(latex, s)
    m = _MIXED_PLAIN_RE.match(s)
    if m and int(m.group(4)) != 0 and int(m.group(3)) < int(m.group(4)):
        sign, whole, num, den = m.groups()
        s = f"{sign}({whole}+{num}/{den})"
    return s


_VAR_PREFIX_RE = re.compile(r"(?:^|(?<=,)|(?<=\bor\b)|(?<=\band\b))\s*[A-Za-z]\w*\s*=\s*")


def strip_variable_prefixes(s: str) -> str:
    """``x = 1, x = 2`` / ``x=1 or x=2`` -> ``1, 2`` (two or more such prefixes only)."""
    if len(_VAR_PREFIX_RE.findall(s)) < 2 or re.search(r"[<>!]=|==", s):
        return s
    s = re.sub(r"\s+(?:or|and)\s+", ",", s)
    return ",".join(part for part in _VAR_PREFIX_RE.sub("", s).split(","))


def _top_level_split(s: str, sep: str) -> list[str]:
    parts, depth, start, i = [], 0, 0, 0
    while i < len(s):
        c = s[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif depth == 0 and s.startswith(sep, i):
            parts.append(s[start:i])
            start = i + len(sep)
            i = start
            continue
        i += 1
    parts.append(s[start:])
    return parts


def _closes_at_end(s: str) -> bool:
    """The bracket opening at ``s[0]`` is the one closing at ``s[-1]`` (any bracket kind)."""
    depth = 0
    for i, c in enumerate(s):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return i == len(s) - 1
    return False


def split_interval(s: str) -> tuple[str, str, str, str] | None:
    """``(left bracket, low, high, right bracket)`` of ``[a, b)``-style text, else None."""
    s = s.strip()
    if len(s) < 5 or s[0] not in "([" or s[-1] not in ")]" or not _closes_at_end(s):
        return None
    if s.startswith("\\"):
        return None
    inner = s[1:-1]
    parts = _top_level_split(inner, ",")
    if len(parts) != 2 or not all(p.strip() for p in parts):
        return None
    return s[0], parts[0].strip(), parts[1].strip(), s[-1]


def split_union(s: str) -> list[str] | None:
    """The intervals of ``A \\cup B \\cup ...`` (two or more), else None."""
    if "\\cup" not in s and "∪" not in s and " U " not in s:
        return None
    s = s.replace("∪", "\\cup").replace(" U ", "\\cup")
    parts = [p.strip() for p in _top_level_split(s, "\\cup")]
    if len(parts) < 2 or not all(split_interval(p) for p in parts):
        return None
    return parts


_UNITS = {
    "zero": 0,
    "one": 1,
    "a": 1,
    "an": 1,
    "two": 2,
    "three": 3,
    "four": 4,
    "five": 5,
    "six": 6,
    "seven": 7,
    "eight": 8,
    "nine": 9,
    "ten": 10,
    "eleven": 11,
    "twelve": 12,
    "thirteen": 13,
    "fourteen": 14,
    "fifteen": 15,
    "sixteen": 16,
    "seventeen": 17,
    "eighteen": 18,
    "nineteen": 19,
    "twenty": 20,
    "thirty": 30,
    "forty": 40,
    "fifty": 50,
    "sixty": 60,
    "seventy": 70,
    "eighty": 80,
    "ninety": 90,
}
_SCALES = {"hundred": 100, "thousand": 1000, "million": 10**6, "billion": 10**9}
_DENOMS = {
    "half": 2,
    "halves": 2,
    "third": 3,
    "thirds": 3,
    "quarter": 4,
    "quarters": 4,
    "fourth": 4,
    "fourths": 4,
    "fifth": 5,
    "fifths": 5,
    "sixth": 6,
    "sixths": 6,
    "eighth": 8,
    "eighths": 8,
    "tenth": 10,
    "tenths": 10,
}


def _integer_words(words: list[str]) -> int | None:
    if not words or words == ["a"] or words == ["an"]:
        return None
    total = current = 0
    seen = False
    for w in words:
        if w == "and":
            continue
        if w in _UNITS:
            current += _UNITS[w]
            seen = True
        elif w == "hundred":
            current = max(current, 1) * 100
            seen = True
        elif w in _SCALES:
            total += max(current, 1) * _SCALES[w]
            current = 0
            seen = True
        else:
            return None
    return total + current if seen else None


def number_from_words(s: str) -> Fraction | None:
    """``twenty-one`` -> 21, ``minus three`` -> -3, ``two thirds`` -> 2/3; else None."""
    words = s.casefold().replace("-", " ").replace(",", " ").split()
    if not words or len(words) > 12:
        return None
    sign = 1
    if words[0] in ("minus", "negative"):
        sign, words = -1, words[1:]
    if words and words[-1] in _DENOMS:
        head = words[:-1]
        num = 1 if head in ([], ["a"], ["an"], ["one"]) else _integer_words(head)
        if num is None:
            return None
        return sign * Fraction(num, _DENOMS[words[-1]])
    n = _integer_words(words)
    return None if n is None else sign * Fraction(n)
