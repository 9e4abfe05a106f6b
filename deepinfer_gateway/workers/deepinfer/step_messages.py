"""What crosses between the event loop and the DeepInfer step thread.

Loop -> thread: the commands `Add`, `Abort` and `Stop`. Thread -> loop: a `Batch` of
`(request_id, protocol event)` per step and the latest `LoadSnapshot`. `RequestError` is a
request refused at admission; the step thread answers it with a finish event of its kind.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from deepinfer_gateway.core.protocol import ErrorKind, GenerateRequest

Event = dict[str, Any]
Batch = list[tuple[str, Event]]


@dataclass(slots=True)
class Add:
    request: GenerateRequest


@dataclass(slots=True)
class Abort:
    request_id: str
    reply: Callable[[bool], None] | None = None  # called on the step thread with "was in flight"


@dataclass(slots=True)
class Stop:
    deadline: float  # time.monotonic() after which the rest is aborted


Command = Add | Abort | Stop


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    running: int = 0
    waiting: int = 0
    queued_prefill_tokens: int = 0
    kv_usage: float = 0.0
    capacity_blocks: int = 0
    dp_rank: int = 0

    @classmethod
    def read(cls, llm: Any) -> LoadSnapshot:
        """What `llm` (an `LLMEngine`, on the step thread) reports now."""
        unfinished = llm.get_num_unfinished_requests()
        waiting = llm.get_num_pendings()  # 0.1.0: number of waiting sequences, not tokens
        scheduler = getattr(llm, "scheduler", None)
        queued = scheduler.get_sum_prompt_len_waiting()[1] if scheduler is not None else 0
        blocks = getattr(getattr(llm, "cache_config", None), "num_gpu_blocks", 0) or 0
        manager = getattr(llm, "block_manager", None)
        usage = 1.0 - manager.get_num_free_blocks() / blocks if manager is not None and blocks else 0.0
        return cls(
            running=max(0, unfinished - waiting),
            waiting=waiting,
            queued_prefill_tokens=queued,
            kv_usage=min(1.0, max(0.0, usage)),
            capacity_blocks=blocks,
            dp_rank=int(getattr(llm, "dp_rank", 0) or 0),
        )


class RequestError(Exception):
    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind
