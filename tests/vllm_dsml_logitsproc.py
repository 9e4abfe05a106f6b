"""A vLLM logits processor for the DSML tool-call test (tests/e2e/test_vllm_tools.py), loaded by
the vLLM server process (`--logits-processors vllm_dsml_logitsproc:DsmlCall`, with tests/ on its
PYTHONPATH).

A random-weight model never writes a DSML tool call, and the gateway sends vLLM no per-request
`allowed_token_ids` or tool grammar. So, in vLLM's own sampling pipeline, this processor does
what `allowed_token_ids` would do one step at a time: for a request whose prompt opens a DSML
calls block (`<｜DSML｜ calls>\\n`, what the template renders for `tool_choice: required`), only
the next token of `TARGET_IDS` keeps its logit; then only EOS. Other requests are untouched.
The ids the gateway receives are vLLM's sampled output; the gateway's parser does the rest.

`TARGET_IDS` and `OPEN_IDS` are read from the environment (DGW_DSML_TARGET_IDS and
DGW_DSML_OPEN_IDS, comma-separated ids), so this module imports nothing from the gateway.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def _ids(name: str) -> list[int]:
    return [int(x) for x in os.environ.get(name, "").split(",") if x]


class DsmlCall(LogitsProcessor):
    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        self.target = _ids("DGW_DSML_TARGET_IDS")
        self.open = _ids("DGW_DSML_OPEN_IDS")
        self.eos = int(os.environ.get("DGW_DSML_EOS_ID", "1"))
        self.rows: dict[int, tuple[list[int], list[int]]] = {}  # batch row -> (prompt, output ids: live)

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.rows.pop(index, None)
        for index, _params, prompt, output in batch_update.added:
            if prompt is not None and self._forced_from(prompt) is not None:
                self.rows[index] = (prompt, output)
            else:
                self.rows.pop(index, None)
        for a, b, direction in batch_update.moved:
            row_a, row_b = self.rows.pop(a, None), self.rows.pop(b, None)
            if row_a is not None:
                self.rows[b] = row_a
            if row_b is not None and str(direction).endswith("SWAP"):
                self.rows[a] = row_b

    def _forced_from(self, prompt: list[int]) -> int | None:
        """How much of the target the prompt already holds after the calls opening (None: not opened)."""
        n = len(self.open)
        for done in range(len(self.target) + 1):
            end = len(prompt) - done
            if end >= n and prompt[end - n:end] == self.open and prompt[end:] == self.target[:done]:
                return done
        return None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, (prompt, output) in self.rows.items():
            done = self._forced_from(prompt)
            assert done is not None
            step = done + len(output)
            token = self.target[step] if step < len(self.target) else self.eos
            keep = logits[index, token].clone()
            logits[index, :] = float("-inf")
            logits[index, token] = keep if torch.isfinite(keep) else 0.0
        return logits

