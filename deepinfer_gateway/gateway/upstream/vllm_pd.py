"""PD disaggregation on vLLM workers: vLLM's `kv_transfer_params` hand-off, as vLLM's own
disaggregated-serving proxies run it. Pure (bodies, events); the calls are in vllm.py.

Prefill leg: the prompt with `max_tokens: 1`, `stream: false` and `kv_transfer_params:
{"do_remote_decode": true, ...}`. The prefill vLLM computes the prompt's KV and its KV
connector keeps it for a decode worker; the answer's `kv_transfer_params` (where the KV waits:
engine, blocks, host and port for NixlConnector; null for connectors that find KV by the
prompt's tokens, such as ExampleConnector) travel as the hand-off's `handle`. The leg's events
are `ready` (vLLM's prompt and cached counts) and a `finish` carrying the hand-off: no token.

Decode leg: the same prompt and sampling with those `kv_transfer_params`, one streamed call:
the decode vLLM's connector loads the prompt's KV, computes what it lacks and samples the first
token. The prefill's token is discarded, as vLLM's proxies do: the decode must see the
prefill's prompt unchanged (NixlConnector loads the KV of every prompt token from the
prefill's blocks, which hold none for a token sampled after the prompt), and under sampling
its first token may differ from the prefill's. So the client's first token comes from the
decode worker, and legs.py opens the decode leg before the client's response starts.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import orjson

from deepinfer_gateway.core import protocol as wp

# What vLLM's proxies send a prefill: "keep this request's KV for a remote decode".
PREFILL_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None,
}
# Fields a prefill leg does not send: its token is discarded, so grammar and logprobs are waste.
_NOT_FOR_PREFILL = ("stream_options", "structured_outputs", "logprobs", "return_tokens_as_token_ids")


def prefill_body(completion: dict[str, Any]) -> dict[str, Any]:
    """A `/v1/completions` body (vllm.completion_body) as the prefill leg's."""
    body = {k: v for k, v in completion.items() if k not in _NOT_FOR_PREFILL}
    body.update(max_tokens=1, stream=False, kv_transfer_params=dict(PREFILL_TRANSFER_PARAMS))
    return body


def decode_body(completion: dict[str, Any], transfer: dict[str, Any] | None) -> dict[str, Any]:
    """A `/v1/completions` body as the decode leg's: the prefill's `kv_transfer_params`, if any."""
    return {**completion, "kv_transfer_params": transfer} if transfer else completion


def handle_of(transfer: dict[str, Any] | None) -> str:
    """The hand-off handle carrying a prefill answer's `kv_transfer_params` ("" when null)."""
    return orjson.dumps(transfer).decode() if transfer else ""


def transfer_of(handoff: dict[str, Any]) -> dict[str, Any] | None:
    """The `kv_transfer_params` in a hand-off made by `prefill_events`; ValueError if it is not one."""
    handle = handoff.get("handle", "")
    if not handle:
        return None
    try:
        transfer = orjson.loads(handle)
    except orjson.JSONDecodeError:
        raise ValueError("the KV hand-off does not come from a vLLM prefill") from None
    if not isinstance(transfer, dict):
        raise ValueError("the KV hand-off does not come from a vLLM prefill")
    return transfer


def prefill_events(answer: Any, source_worker: str, kv_format: str) -> list[dict[str, Any]]:
    """The prefill leg's events from vLLM's non-streamed answer; ValueError if it is not one."""
    try:
        choice = answer["choices"][0]
        usage = answer["usage"]
        prompt_tokens = int(usage["prompt_tokens"])
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        transfer = answer.get("kv_transfer_params")
    except (KeyError, IndexError, TypeError, ValueError, AttributeError):
        raise ValueError("not a completion answer with usage") from None
    if transfer is not None and not isinstance(transfer, dict):
        raise ValueError("kv_transfer_params is not an object")
    ready = wp.ready_event(prompt_tokens, cached, 0)
    if choice.get("finish_reason") == "abort":  # vLLM dropped it (e.g. shutting down): retried elsewhere
        return [ready, wp.finish_event(wp.FinishReason.ABORT)]
    handoff = wp.KvHandoff(handle=handle_of(transfer), source_worker=source_worker, kv_format=kv_format,
                           num_tokens=prompt_tokens)
    return [ready, wp.finish_event(wp.FinishReason.STOP, kv_handoff=handoff)]


class HeldEvents:
    """A finished call's events, read like an open stream (the prefill leg's answer is one body)."""

    def __init__(self, events: list[dict[str, Any]]):
        self._events = deque(events)

    async def next_event(self) -> dict[str, Any] | None:
        return self._events.popleft() if self._events else None

    def buffered(self) -> bool:
        return True  # every event is in hand; at the end, None without waiting

    def close(self) -> None:
        self._events.clear()
