"""Pure answer-extraction helpers for verifiable rewards (no I/O, never raise).

They live in ``reward`` (not ``data``) because the reward layer must not import the data
layer; ``data`` re-uses them.
"""

from __future__ import annotations

import math
import re
from typing import Any

__all__ = ["END_MARKERS", "extract_integer_answer", "parse_int_answer", "strip_special_tokens"]

# Markers after which a decoded completion is junk (the model ended its turn).
END_MARKERS: tuple[str, ...] = (
    "</s>",
    "<eos>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<|im_end|>",
    "<|eot_id|>",
    "<|end|>",
    "<end_of_turn>",
    "[EOS]",
    "[SEP]",
)

# Other special-token-looking pieces that may survive decoding; some carry digits
# (``<|reserved_special_token_5|>``, ``<extra_id_0>``) that must not be read as answers.
_SPECIAL_TOKEN_RE = re.compile(
    r"<\|[^<>|]{0,80}\|>|</?(?:s|pad|unk|bos|eos|mask)>|<extra_id_\d{1,6}>"
    r"|\[(?:PAD|CLS|BOS|UNK|MASK)\]"
)

# A sign counts only when the '-' is not preceded by a digit: in "10-3" it is an operator.
_INT_RE = re.compile(r"(?:(?<![0-9])-)?[0-9]+")
_LEADING_INT_RE = re.compile(r"\s*(-?[0-9]+)")
_INT_ANSWER_RE = re.compile(r"[+-]?[0-9]+(?:\.0*)?")

# Minus-like characters that models (and copy-pasted datasets) use for '-'.
_MINUS_TRANSLATION = str.maketrans({"\u2212": "-", "\u2013": "-", "\ufe63": "-", "\uff0d": "-"})


def strip_special_tokens(text: str) -> str:
    """Cut ``text`` at the first end-of-turn marker and blank out other special tokens."""
    cut = len(text)
    for marker in END_MARKERS:
        i = text.find(marker)
        if i != -1 and i < cut:
            cut = i
    return _SPECIAL_TOKEN_RE.sub(" ", text[:cut])


def _to_int(digits: str) -> int | None:
    try:
        return int(digits)
    except ValueError:  # e.g. more digits than sys.get_int_max_str_digits() allows
        return None


def extract_integer_answer(text: str) -> int | None:
    """Return the integer answer of a completion, or None when it holds none.

    Rule, applied after cutting the text at the first end-of-turn marker (``</s>``,
    ``<|endoftext|>``, ``<|im_end|>``, ...), blanking other special tokens, and mapping
    Unicode minus signs to ``-``:

    1. if the completion starts (after optional whitespace) with an integer, that first
       integer is the answer: ``" 12abc" -> 12``, ``"7 then 8" -> 7``, ``"1e5" -> 1``,
       ``"-3" -> -3``, ``"12.5" -> 12``;
    2. otherwise the answer is the last integer in the text:
       ``"answer is 7" -> 7``, ``"x = -4" -> -4``. A ``-`` right after a digit is an
       operator, not a sign: ``"so 10-3" -> 3``.

    Only ASCII digits count. Never raises: a non-string, an integer too long for ``int``
    or any other failure gives None.
    """
    try:
        if not isinstance(text, str):
            return None
        cleaned = strip_special_tokens(text.translate(_MINUS_TRANSLATION))
        m = _LEADING_INT_RE.match(cleaned)
        if m is not None:
            return _to_int(m.group(1))
        found = _INT_RE.findall(cleaned)
        return _to_int(found[-1]) if found else None
    except Exception:  # a verifier must never crash the reward path
        return None


def parse_int_answer(value: Any) -> int | None:
    """Parse a reference answer field into an int, or None when it is not an integer.

    Accepts ints, integral floats, and strings like ``"8"``, ``" -3 "``, ``"+4"``, ``"8.0"``.
    Booleans, None, non-integral numbers and anything else give None. Never raises.
    """
    try:
        if isinstance(value, bool) or value is None:
            return None
        if isinstance(value, int):
            return value
        if isinstance(value, float):
            return int(value) if math.isfinite(value) and value.is_integer() else None
        if isinstance(value, str):
            s = value.strip().translate(_MINUS_TRANSLATION)
            if not _INT_ANSWER_RE.fullmatch(s):
                return None
            return _to_int(s.split(".", 1)[0])
        return None
    except Exception:  # never raise: a malformed field simply fails verification
        return None
