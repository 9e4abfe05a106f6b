"""Prompt encoding: Conversation -> token ids, with deepseek-recipe's V4.1 template.

`PromptEncoder` is the seam the incremental (segment-cached) encoder plugs into; this
base version calls deepseek-recipe's own `encode` every time and is the reference the
fast path must match token for token.
"""

from __future__ import annotations

import deepseek_recipe as dr

from deepinfer_gateway.recipe_bridge.tokenizer import TokenizerBundle


class PromptEncoder:
    def __init__(self, bundle: TokenizerBundle):
        self.bundle = bundle
        self._encoding = dr.DeepseekV41Encoding().with_tokenizer(bundle.tokenizer)

    def encode(self, conversation: dr.Conversation) -> list[int]:
        return self._encoding.encode(conversation)
