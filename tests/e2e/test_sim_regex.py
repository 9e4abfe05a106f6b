"""A client's structured-output regex through the real openai SDK -> gateway -> sim worker: the
worker matches it with RE2 (linear time), so a pattern that backtracks catastrophically in
Python's `re` cannot hold the worker."""

from __future__ import annotations

import time

import openai

MODEL = "DeepSeek-V4.1-Flash"
# Nested stars over the candidates the sim tries: Python's `re` takes minutes to fail on "2025-01-01".
CATASTROPHIC = "(.*)*" * 12 + "!"


def _answer(client: openai.OpenAI, pattern: str) -> str:
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Answer"}], max_tokens=200,
        response_format={"type": "regex", "regex": pattern},
        extra_body={"thinking": {"type": "disabled"}})
    return reply.choices[0].message.content or ""


def test_catastrophic_regex_is_answered_fast(openai_client: openai.OpenAI) -> None:
    assert _answer(openai_client, r"\d{4}-\d\d-\d\d") == "2025-01-01"  # the regex reaches the worker
    started = time.monotonic()
    answer = _answer(openai_client, CATASTROPHIC)
    assert time.monotonic() - started < 5
    assert answer and not answer.endswith("!")  # unmatched: the sim's plain answer
