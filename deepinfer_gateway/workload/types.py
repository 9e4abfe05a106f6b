"""Workload and record value types, shared by `loadgen/` and `simulate/` (a leaf: imports no sibling).

`TraceRequest` is one request of a workload (trace file or synthetic generator);
`RequestRecord` is what one replayed request measured, one line of `results.jsonl`.
The offline simulator produces `RequestRecord`s too, so `summary.summarize` serves both.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson

MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a workload.

    arrival_s: seconds since the trace's first request (rebased to 0).
    hash_ids: prefix-chain block ids (one per `Trace.block_size` tokens, the last block
    possibly partial), or None when the trace has no prefix information.
    """

    index: int
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class Trace:
    name: str
    requests: tuple[TraceRequest, ...]
    block_size: int = MOONCAKE_BLOCK_TOKENS

    @property
    def has_prefix_info(self) -> bool:
        return bool(self.requests) and all(r.hash_ids is not None for r in self.requests)

    def head(self, n: int | None) -> Trace:
        return self if n is None else Trace(self.name, self.requests[:n], self.block_size)


class RecordError:
    """`RequestRecord.error` values (a bounded set, used as keys of summary `errors`)."""

    TIMEOUT = "timeout"
    CONNECT = "connect"  # no connection could be opened (refused, unreachable): the server never got the request
    CONNECTION = "connection"  # the connection failed after it was opened
    HTTP_4XX = "http_4xx"
    HTTP_5XX = "http_5xx"
    RATE_LIMITED = "rate_limited"
    STREAM = "stream"  # broken or malformed stream after the response started
    CANCELLED = "cancelled"  # still running when the run's time bound ended it
    CLIENT = "client"  # anything else raised in the client
    DEPENDENCY = "dependency"  # a session round not sent: a round it continues failed


@dataclass(slots=True)
class RequestRecord:
    """What one request measured. Times in seconds; `arrival_s` relative to the run start.

    ttft_s / e2e_s are None for failed requests. `itl_s` holds every gap between
    consecutive content-bearing stream chunks (a chunk may carry several tokens).
    `cached_tokens` is None when the server did not report it.
    """

    index: int
    arrival_s: float
    status: str = "ok"  # "ok" or "error"
    error: str | None = None
    detail: str | None = None  # exception text of a failed request (truncated)
    http_status: int | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int | None = None
    expected_input_tokens: int | None = None
    expected_output_tokens: int | None = None
    worker: str | None = None
    send_lag_s: float | None = None  # open loop: actual send time minus scheduled time
    session_id: str | None = None  # closed-loop sessions: the round's session and position in it
    round_idx: int | None = None
    planned_cached_tokens: int | None = None  # a follow-up round: what a perfect cache serves of it
    reasoning: bool = False  # the answer began with reasoning (chat templates drop it from later turns)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (output_tokens - 1)."""
        if self.ttft_s is None or self.e2e_s is None or not self.output_tokens or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestRecord:
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        return cls(**known)


def write_records(path: Path, records: list[RequestRecord]) -> None:
    with open(path, "wb") as f:
        f.writelines(orjson.dumps(record.to_dict()) + b"\n" for record in records)


def read_records(path: Path) -> list[RequestRecord]:
    with open(path, "rb") as f:
        return [RequestRecord.from_dict(orjson.loads(line)) for line in f if line.strip()]


def key_values(text: str, error: type[ValueError] = ValueError) -> dict[str, str]:
    """`k=v,k=v` (a trace spec's parameters) -> {k: v}; `error` names a part without `=`."""
    params: dict[str, str] = {}
    for part in filter(None, text.split(",")):
        key, sep, value = part.partition("=")
        if not sep:
            raise error(f"parameter {part!r} is not key=value")
        params[key.strip()] = value.strip()
    return params
