"""Moved: the prompt pipeline is ``relayrl.data.prompts``; these names stay importable here for
code written against earlier docs (``from relayrl.controller.prompts import PromptSource``)."""

from relayrl.data.prompts import PromptSource, TokenizedPrompt

__all__ = ["PromptSource", "TokenizedPrompt"]
