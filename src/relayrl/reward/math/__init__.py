"""Math answer verification: a completion's final answer extracted, parsed and compared with
the reference (``answer``), with the extraction rules (``extract``), the parser (``parse``)
and the equivalent forms it accepts (``forms``)."""

from relayrl.reward.math.answer import (
    answers_equal,
    extract_final_answer,
    parse_answer,
    verify_math,
)

__all__ = ["answers_equal", "extract_final_answer", "parse_answer", "verify_math"]
