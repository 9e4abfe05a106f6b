"""Deterministic, readable model output as token ids.

The sim sees only token ids, so it reads its prompt like a model would: it decodes the
prompt's last TAIL_TOKENS tokens and looks at how the V4.1 template left off:
- `...<｜Assistant｜><think>`: thinking on: reasoning, `</think>`, then the answer;
- `...<｜Assistant｜></think>`: thinking off: the answer only;
- `...</think>\n\n<｜DSML｜ calls>\n`: a required tool call was opened by the prompt;
- `</tool_result>` right before `<｜Assistant｜>`: the last turn is a tool result, so
  the answer is text even when tools are offered.
With `so_args.schema_type` `tool_call`/`tool_call_required` (schema = the Chat
Completions tools as JSON) the answer is a DSML calls block, with arguments satisfying
each tool's schema, in the template's format: one call of every offered tool whose name
the last user message mentions (parallel tool calls), or of the first tool when it
names none. `json` gives a minimal schema-valid
value; `regex` tries a few candidate strings with RE2's fullmatch (best effort: an
unmatched regex, or one RE2 cannot run, gets plain text); `ebnf` is ignored.

The output ends where the model would emit EOS (finish `stop`; like every stop token,
EOS itself is not streamed) unless `max_tokens` cuts it (`length`); `ignore_eos` pads
the answer out to `max_tokens`, `min_tokens` to at least that many tokens (a tool call
inside its first string argument, so the call stays whole: a longer command, not text
after the call). Variants are picked by a hash of
(prompt, seed), so a retry on another worker produces the same text. Each distinct
text is tokenized once and cached.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import re2

from deepinfer_gateway.core.protocol import FinishReason, Sampling
from deepinfer_gateway.recipe_bridge.detokenizer import token_bytes
from deepinfer_gateway.recipe_bridge.tokenizer import TokenizerBundle
from deepinfer_gateway.workers.sim.json_values import example_value

TAIL_TOKENS = 64
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
ASSISTANT = "<｜Assistant｜>"
USER = "<｜User｜>"
DSML = "｜DSML｜"
CALLS_OPEN = f"<{DSML} calls>\n"

_REASONING = (
    "The user wants a clear answer. I will restate the question, check the key facts, and reply briefly.",
    "Let me think about what is being asked. A short, direct answer with one example should be enough.",
    "I should read the request carefully, consider the context so far, and give a concise reply.",
)
_ANSWERS = (
    "Here is a short answer from the simulated DeepInfer engine. "
    "It has no model weights, so this text is a placeholder.",
    "This reply comes from the DeepInfer simulator: the tokens are real, the wisdom is not.",
    "Simulated answer: the request was received, scheduled, prefilled and decoded on a simulated worker.",
)
_TOOL_RESULT_ANSWERS = (
    "Based on the tool result, here is the answer you asked for.",
    "The tool returned its result; summarising it: everything looks fine.",
)
# A client's pattern runs on RE2 (linear in the input, no backtracking): Python's `re` lets a
# pattern like `(.*)*(.*)*...!` hold the worker's event loop for minutes. RE2's own bounds
# (max_mem, repetition <= 1000) refuse oversized patterns at compile time. No logging: every
# unsupported pattern (backreferences, lookaround) would otherwise print to stderr.
_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False
_RE2_OPTIONS.never_capture = True
_REGEX_CANDIDATES = ("yes", "no", "a", "0", "42", "abc", "example", "2025-01-01", "a@example.com", "")
_STRING_ARGUMENT = 'string="true">'  # where a call's first string argument's value begins
_FILLER_WORD = " x"


@dataclass(frozen=True)
class OutputPlan:
    token_ids: list[int]
    finish_reason: FinishReason


@dataclass(frozen=True)
class PromptShape:
    thinking: bool
    in_tool_calls: bool
    after_tool_result: bool
    last_user: str = ""  # the last user message, as far as the tail shows it


def read_tail(tail: str) -> PromptShape:
    in_tool_calls = tail.endswith(CALLS_OPEN)
    thinking = tail.endswith(THINK_OPEN)
    turn_end = tail.removesuffix(THINK_OPEN).removesuffix(THINK_CLOSE)
    last_user = tail.rpartition(USER)[2].partition(ASSISTANT)[0] if USER in tail else ""
    return PromptShape(thinking, in_tool_calls, turn_end.endswith("</tool_result>" + ASSISTANT), last_user)


def dsml_invoke(tool: dict[str, Any]) -> str:
    """One `<｜DSML｜ invoke>` block calling `tool` (a Chat Completions function tool)."""
    function = tool.get("function", tool)
    args = example_value(function.get("parameters") or {"type": "object", "properties": {}})
    lines = [f'<{DSML} invoke name="{function["name"]}">']
    for key, value in (args if isinstance(args, dict) else {}).items():
        is_str = isinstance(value, str)
        text = value if is_str else json.dumps(value, ensure_ascii=False)
        string = "true" if is_str else "false"
        lines.append(f'<{DSML} parameter name="{key}" string="{string}">{text}</{DSML} parameter>')
    lines.append(f"</{DSML} invoke>")
    return "\n".join(lines) + "\n"


def regex_example(pattern: str) -> str | None:
    try:
        compiled = re2.compile(pattern, options=_RE2_OPTIONS)
    except re2.error:
        return None
    return next((c for c in _REGEX_CANDIDATES if compiled.fullmatch(c)), None)


class OutputPlanner:
    """Plans the whole output of a request up front (the scheduler then emits it)."""

    def __init__(self, bundle: TokenizerBundle) -> None:
        self._tokenizer = bundle.tokenizer
        self._detok = token_bytes(bundle.json_text)  # ~0.4 s to build: once per vocabulary
        self.eos_id = bundle.eos_token_id
        self.vocab_size = bundle.vocab_size
        self._encode = lru_cache(maxsize=4096)(self._encode_uncached)

    def _encode_uncached(self, text: str) -> tuple[int, ...]:
        return tuple(self._tokenizer.encode(text))

    def plan(self, prompt: Sequence[int], sampling: Sampling) -> OutputPlan:
        shape = read_tail(self._detok.decode(prompt[-TAIL_TOKENS:]))
        pick = _picker(prompt, sampling.seq_seed)
        text = self._text(shape, sampling, pick)
        ids = list(self._encode(text))
        # ignore_eos pads the answer to max_tokens, min_tokens to its minimum (no EOS before it).
        length = sampling.max_tokens if sampling.ignore_eos else sampling.min_tokens
        if len(ids) < length and _STRING_ARGUMENT in text:
            ids = self._longer_call(text, length)
        if len(ids) < length:
            filler = self._encode(" " + pick(_ANSWERS))
            while len(ids) < length:
                ids.extend(filler)
        # The EOS that would follow is not part of the plan: stop tokens are not streamed.
        if len(ids) >= sampling.max_tokens:
            return OutputPlan(ids[: sampling.max_tokens], FinishReason.LENGTH)
        return OutputPlan(ids, FinishReason.STOP)

    def _longer_call(self, text: str, length: int) -> list[int]:
        """`text` (a calls block) lengthened in its first string argument to at least `length` tokens."""
        head, marker, rest = text.partition(_STRING_ARGUMENT)
        value, end, tail = rest.partition(f"</{DSML} parameter>")
        words = length - len(self._encode(text))
        for _ in range(3):  # a filler word is about one token: what is left after a try is added
            ids = list(self._tokenizer.encode(head + marker + value + _FILLER_WORD * words + end + tail))
            if len(ids) >= length:
                break
            words += length - len(ids)
        return ids

    def _text(self, shape: PromptShape, sampling: Sampling, pick: _Pick) -> str:
        so = sampling.so_args
        tool_call = so is not None and so.schema_type in ("tool_call", "tool_call_required")
        if shape.in_tool_calls:  # the prompt already opened the calls block
            return _invokes(so.schema_ if so else "", shape.last_user) + f"</{DSML} calls>"
        head = pick(_REASONING) + THINK_CLOSE if shape.thinking else ""
        if tool_call and so is not None and not shape.after_tool_result:
            return f"{head}\n\n{CALLS_OPEN}{_invokes(so.schema_, shape.last_user)}</{DSML} calls>"
        if shape.after_tool_result:
            return head + pick(_TOOL_RESULT_ANSWERS)
        if so is not None and so.schema_type == "json":
            schema = json.loads(so.schema_) if so.schema_.strip() else None
            value = example_value(schema) if schema is not None else {"answer": pick(_ANSWERS)}
            return head + json.dumps(value, ensure_ascii=False)
        if so is not None and so.schema_type == "regex":
            match = regex_example(so.schema_)
            if match is not None:
                return head + match
        return head + pick(_ANSWERS)


def fake_logprobs(token_ids: Sequence[int], top: int) -> list[Any]:
    """Deterministic stand-in log probabilities in the worker protocol's shape: one
    `[logprob, [[token_id, logprob], ...]]` per token. The emitted token is always the most
    likely one; `top - 1` alternatives follow with strictly lower log probabilities."""
    out: list[Any] = []
    for t in token_ids:
        lp = -((t * 2654435761) % 1000) / 4000.0  # in (-0.25, 0]
        alternatives = [[(t + 7919 * k) % 100_000, lp - k - 0.5] for k in range(1, top)]
        out.append([lp, ([[t, lp]] if top else []) + alternatives])
    return out


class _Pick:
    def __init__(self, seed: int) -> None:
        self.seed = seed

    def __call__(self, options: Sequence[str]) -> str:
        return options[self.seed % len(options)]


def _picker(prompt: Sequence[int], seed: int | None) -> _Pick:
    digest = hashlib.blake2b(array("I", prompt).tobytes() + str(seed).encode(), digest_size=8).digest()
    return _Pick(int.from_bytes(digest, "little"))


def _invokes(schema: str, last_user: str) -> str:
    tools = json.loads(schema) if schema.strip() else []
    named = [t for t in tools if _tool_name(t) and _tool_name(t) in last_user]
    return "".join(dsml_invoke(t) for t in named) if named else dsml_invoke(_first_tool(schema))


def _tool_name(tool: dict[str, Any]) -> str:
    return str(tool.get("function", tool).get("name", ""))


def _first_tool(schema: str) -> dict[str, Any]:
    tools = json.loads(schema) if schema.strip() else []
    if not tools:
        return {"name": "tool", "parameters": {"type": "object", "properties": {}}}
    return dict(tools[0])
