"""PD hand-off: the `LLMEngine` subclass with the hooks DeepInfer leaves empty, and the
one adapter (`KvTransfer`) that moves KV bytes between GPU blocks and the KV store.

What deepinfer 0.1.0 actually provides (read from its llm_engine.py):
- prefill (`EngineType.PROMPT`): `pre_sampler_sync` calls
  `pe_prepare_save_kvcache(scheduled, finished)` before sampling and `post_process` calls
  `pe_do_save_kvcache(scheduled, finished)` after the model ran, before the step's
  `RequestOutput`s are built. Both take `list[Sequence]`; a `Sequence` exposes
  `request_id`, `get_prompt_len()`, `num_cached_tokens`, `status`, but NOT its block table.
- decode (`EngineType.COMPLETION`): `do_save_kvcache` / `should_copy_state` /
  `finalize_seq` exist, but they SAVE decode-side KV (for later turns); the release has
  no hook and no pybind scheduler method to admit a sequence whose KV was loaded
  elsewhere (the C++ scheduler's `prompted` queue is filled only by `fork_seq`), and a
  COMPLETION scheduler has no prefill channel, so a plain `add_request` never runs.

ASSUMPTION (loud): reading a sequence's prompt KV out of the paged cache and writing
it into a decode engine's blocks, then admitting the sequence, needs DeepInfer internals
0.1.0 does not expose to Python. All of it sits behind `KvTransfer`; the wrapper only
relies on: prefill KV is complete and readable inside `pe_do_save_kvcache`, and on the
decode side `add_request(..., enqueue=False)` returns a `Sequence` that
`KvTransfer.import_prompt_kv` can fill and enqueue before the next `step()`.
`UnavailableKvTransfer` (the default for real hardware) fails at start for prefill and
decode roles instead of serving wrong tokens. The tests use the double's implementation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol


class KvTransfer(Protocol):
    def check(self, engine: Any) -> None:
        """Raise if this adapter cannot work with `engine` (called once, at start)."""

    def export_prompt_kv(self, engine: Any, seq: Any) -> list[bytes] | None:
        """Prefill side, inside `pe_do_save_kvcache`: the KV of `seq`'s whole prompt, one
        bytes object per 128-token block (the last one partial when the prompt is), or
        None while the prompt is not fully prefilled (chunked prefill)."""

    def import_prompt_kv(self, engine: Any, seq: Any, blocks: list[bytes]) -> None:
        """Decode side: write `blocks` into the KV of `seq` (from `add_request(enqueue=False)`)
        and hand it to the scheduler so that its first step is a decode step."""


class UnavailableKvTransfer:
    """The honest default for real DeepInfer 0.1.0: see the module docstring."""

    def check(self, engine: Any) -> None:
        raise RuntimeError(
            "PD hand-off (--role prefill|decode) on real DeepInfer needs a KvTransfer adapter "
            "that reads/writes paged KV blocks; deepinfer 0.1.0 exposes neither a sequence's "
            "block table nor a way to admit a pre-filled sequence to a COMPLETION engine. "
            "Use --role unified, or supply a KvTransfer (see workers/deepinfer/transfer.py)."
        )

    def export_prompt_kv(self, engine: Any, seq: Any) -> list[bytes] | None:
        raise NotImplementedError

    def import_prompt_kv(self, engine: Any, seq: Any, blocks: list[bytes]) -> None:
        raise NotImplementedError


PromptKvSink = Callable[[str, list[bytes]], None]


def pd_engine_class(base: type[Any], transfer: KvTransfer, sink: PromptKvSink) -> type[Any]:
    """`base` (DeepInfer's LLMEngine) with the prefill save hooks filled in.

    Built per wrapper instance so the hooks reach that instance's transfer and sink without
    globals; `LLMEngine.from_engine_args` is a classmethod, so it builds the subclass.
    The sink runs on the step thread, before this step's outputs are returned.
    """

    class PdLLMEngine(base):  # type: ignore[misc]  # DeepInfer is untyped: `base` is Any to mypy
        def pe_prepare_save_kvcache(self, scheduled: list[Any], finished: list[Any]) -> None:
            # Nothing to stage: the KV is read after the model ran, in pe_do_save_kvcache.
            super().pe_prepare_save_kvcache(scheduled, finished)

        def pe_do_save_kvcache(self, scheduled: list[Any], finished: list[Any]) -> None:
            super().pe_do_save_kvcache(scheduled, finished)
            for seq in scheduled:
                blocks = transfer.export_prompt_kv(self, seq)
                if blocks is not None:
                    sink(seq.request_id, blocks)

    PdLLMEngine.__name__ = PdLLMEngine.__qualname__ = f"Pd{base.__name__}"
    return PdLLMEngine
