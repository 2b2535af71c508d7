"""The synthetic "city language": a small grammar whose true preference score is known.

A sentence describes a city with one to ``MAX_ATTRIBUTES`` distinct attribute words::

    rome is calm .
    rome is calm and dirty .
    rome is calm , old and dirty .

Words are separated by single spaces (punctuation too), so a word-level tokenizer sees one
token per word. The prompt is ``"<city> is"`` and the completion is the attribute list and the
full stop. Grammar (the completion, as a word list)::

    completion := ATTR "."  |  ATTR "and" ATTR "."  |  ATTR "," ATTR "and" ATTR "."
    ATTR       := a GOOD, BAD or NEUTRAL word, all attributes of a sentence distinct

True score (the ground truth the reward model only sees through noisy pairwise labels)::

    s(x, y) = #GOOD(y) - #BAD(y)     if x + y is grammatical
    s(x, y) = -3                     if it is ungrammatical or unfinished (no final ".")

so grammatical scores lie in [-3, 3] and breaking the grammar is as bad as the worst sentence.
Preference labels follow Bradley-Terry on the true score, P(a > b) = sigmoid((s_a - s_b) / T);
ties (s_a = s_b) are coin flips.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "BAD",
    "CITIES",
    "GOOD",
    "MAX_ATTRIBUTES",
    "NEUTRAL",
    "UNGRAMMATICAL_SCORE",
    "CityLanguage",
    "Verdict",
    "bt_label_probability",
    "grammatical_reward",
    "judge",
    "noise_ceiling",
    "shuffle_words",
    "true_score",
    "true_score_reward",
    "vocabulary",
]

CITIES = ("rome", "oslo", "lima", "kyiv", "bern", "doha", "baku", "riga", "cairo", "quito")
GOOD = ("clean", "safe", "green", "calm", "sunny", "rich")
BAD = ("dirty", "loud", "grey", "poor", "unsafe", "crowded")
NEUTRAL = ("old", "big", "flat", "small", "new", "far")
ATTRIBUTES = GOOD + BAD + NEUTRAL
FUNCTION_WORDS = ("is", ",", "and", ".")
MAX_ATTRIBUTES = 3
UNGRAMMATICAL_SCORE = -3.0

_GOOD = frozenset(GOOD)
_BAD = frozenset(BAD)
_ATTRS = frozenset(ATTRIBUTES)


def vocabulary() -> list[str]:
    """Every word of the language (cities, attributes, function words), in a fixed order."""
    return [*CITIES, *FUNCTION_WORDS, *ATTRIBUTES]


@dataclass(frozen=True)
class Verdict:
    """The grammar's judgement of one completion."""

    grammatical: bool
    finished: bool  # ends with "." (an unfinished completion is never grammatical)
    good: int
    bad: int
    score: float


def _attribute_list(words: Sequence[str]) -> list[str] | None:
    """The attributes of ``a`` / ``a and b`` / ``a , b and c`` (``.`` stripped), else None."""
    n = len(words)
    if n == 1:
        attrs = [words[0]]
    elif n == 3 and words[1] == "and":
        attrs = [words[0], words[2]]
    elif n == 5 and words[1] == "," and words[3] == "and":
        attrs = [words[0], words[2], words[4]]
    else:
        return None
    if not all(a in _ATTRS for a in attrs) or len(set(attrs)) != len(attrs):
        return None
    return attrs


def judge(prompt: str, completion: str) -> Verdict:
    """Parse ``prompt + completion`` against the grammar and compute the true score.

    The prompt must be ``"<city> is"``; the completion the attribute list and ``"."``.
    Extra whitespace is ignored; any other deviation makes the sentence ungrammatical.
    """
    p = prompt.split()
    words = completion.split()
    finished = bool(words) and words[-1] == "."
    good = sum(w in _GOOD for w in words)
    bad = sum(w in _BAD for w in words)
    prompt_ok = len(p) == 2 and p[0] in CITIES and p[1] == "is"
    attrs = _attribute_list(words[:-1]) if finished and prompt_ok else None
    if attrs is None:
        return Verdict(False, finished, good, bad, UNGRAMMATICAL_SCORE)
    return Verdict(True, True, good, bad, float(good - bad))


def true_score(prompt: str, completion: str) -> float:
    """s = #good - #bad for a grammatical sentence, -3 otherwise (see the module docstring)."""
    return judge(prompt, completion).score


def true_score_reward(prompt: str, completion: str, sample: dict) -> dict[str, float]:
    """Reward-function form of the true score (``reward.fn`` / ``monitor.gold_fn`` spec
    ``relayrl.data.city_lang:true_score_reward``); components ``grammatical`` and
    ``finished`` are 0/1 so their batch means are fractions."""
    v = judge(prompt, completion)
    return {"score": v.score, "grammatical": float(v.grammatical), "finished": float(v.finished)}


def grammatical_reward(prompt: str, completion: str, sample: dict) -> float:
    """A rule-based reward: 1.0 for a grammatical sentence, 0.0 otherwise."""
    return 1.0 if judge(prompt, completion).grammatical else 0.0


def bt_label_probability(score_a: float, score_b: float, temperature: float = 1.0) -> float:
    """Bradley-Terry: P(a preferred over b) = sigmoid((s_a - s_b) / T)."""
    z = (score_a - score_b) / temperature
    return 1.0 / (1.0 + math.exp(-z)) if z >= 0 else math.exp(z) / (1.0 + math.exp(z))


def noise_ceiling(score_pairs: Sequence[tuple[float, float]], temperature: float = 1.0) -> float:
    """Best expected agreement with Bradley-Terry labels: mean over pairs of max(p, 1 - p),
    p = sigmoid((s_a - s_b) / T). No scorer can beat it in expectation (ties give 0.5)."""
    if not score_pairs:
        return float("nan")
    total = 0.0
    for a, b in score_pairs:
        p = bt_label_probability(a, b, temperature)
        total += max(p, 1.0 - p)
    return total / len(score_pairs)


def shuffle_words(completion: str, rng: random.Random, max_tries: int = 20) -> str:
    """The blind-spot probe: the completion's words in a random order different from the
    original (the same bag of words, so a bag-of-words scorer cannot tell them apart)."""
    words = completion.split()
    if len(set(words)) < 2:
        return completion
    for _ in range(max_tries):
        shuffled = words[:]
        rng.shuffle(shuffled)
        if shuffled != words:
            return " ".join(shuffled)
    return " ".join(words[1:] + words[:1])


class CityLanguage:
    """Samples grammatical sentences: a uniform city, 1..3 attributes (length weights
    ``length_weights``), each attribute drawn uniformly without replacement from all 18, so
    the mean true score of the sampled language is 0."""

    def __init__(self, seed: int = 0, length_weights: Sequence[float] = (0.3, 0.4, 0.3)):
        if len(length_weights) != MAX_ATTRIBUTES:
            raise ValueError(f"length_weights needs {MAX_ATTRIBUTES} entries")
        self.rng = random.Random(seed)
        self.length_weights = list(length_weights)

    @staticmethod
    def prompt(city: str) -> str:
        return f"{city} is"

    @staticmethod
    def render(attributes: Sequence[str]) -> str:
        """The completion for an attribute list: ``a .``, ``a and b .``, ``a , b and c .``."""
        if not 1 <= len(attributes) <= MAX_ATTRIBUTES:
            raise ValueError(f"1..{MAX_ATTRIBUTES} attributes, got {len(attributes)}")
        if len(attributes) == 1:
            body = attributes[0]
        elif len(attributes) == 2:
            body = f"{attributes[0]} and {attributes[1]}"
        else:
            body = f"{attributes[0]} , {attributes[1]} and {attributes[2]}"
        return body + " ."

    def sample(self) -> tuple[str, str]:
        """One (prompt, completion) pair of the language."""
        city = self.rng.choice(CITIES)
        n = self.rng.choices(range(1, MAX_ATTRIBUTES + 1), weights=self.length_weights)[0]
        return self.prompt(city), self.render(self.rng.sample(ATTRIBUTES, n))

    def sample_many(self, n: int) -> list[tuple[str, str]]:
        return [self.sample() for _ in range(n)]
