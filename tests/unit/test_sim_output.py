"""The sim's output, pushed through deepseek-recipe's own stream parser, parses as the
V4.1 template intends: reasoning, content and DSML tool calls."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from deepseek_recipe import (
    ChatCompletionRequest,
    ConversionOptions,
    DeepseekV41Encoding,
    InferenceChunk,
    InferenceFinishReason,
    PromptUsage,
    StreamProcessor,
)

from deepinfer_gateway.core.protocol import FinishReason, Sampling, StructuredOutput
from deepinfer_gateway.recipe_bridge.tokenizer import load_tokenizer
from deepinfer_gateway.workers.sim.output import OutputPlanner, regex_example

MODEL = "DeepSeek-V4.1-Flash"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "units": {"enum": ["c", "f"]}},
                "required": ["city", "days"],
            },
        },
    },
    {"type": "function", "function": {"name": "other", "parameters": {"type": "object", "properties": {}}}},
]


message_tokens = [0]  # the last run_chat's output tokens


@pytest.fixture(scope="module")
def planner() -> OutputPlanner:
    return OutputPlanner(load_tokenizer())


def run_chat(planner: OutputPlanner, body: dict[str, Any], max_tokens: int = 4096,
             min_tokens: int = 0) -> tuple[dict[str, Any], FinishReason]:
    """Prompt -> sim output -> StreamProcessor -> accumulated Chat Completions message."""
    bundle = load_tokenizer()
    conv = ChatCompletionRequest({"model": MODEL, **body}).convert(ConversionOptions())
    prompt = DeepseekV41Encoding().with_tokenizer(bundle.tokenizer).encode(conv.conversation)
    constraint = conv.inference_options.output_constraint
    so = StructuredOutput(schema_type=constraint.kind, schema_=constraint.schema) if constraint else None
    plan = planner.plan(prompt, Sampling(max_tokens=max_tokens, min_tokens=min_tokens, so_args=so))
    message_tokens[0] = len(plan.token_ids)
    proc = StreamProcessor(ChatCompletionRequest.chunk_generator(conv, "id", MODEL), conv.parsing_options,
                           bundle.tokenizer)
    chunks = proc.push(InferenceChunk.ready(prompt_usage=PromptUsage(prompt_tokens=len(prompt))))
    for token in plan.token_ids:  # one token per push: the parser must cope with any split
        chunks += proc.push(InferenceChunk.tokens([token]))
    reason = InferenceFinishReason.Stop if plan.finish_reason is FinishReason.STOP else InferenceFinishReason.Length
    chunks += proc.push(InferenceChunk.finish(reason))
    chunks += proc.finish()
    message: dict[str, Any] = {"content": "", "reasoning_content": "", "tool_calls": {}}
    for chunk in chunks:
        for choice in json.loads(chunk.to_json()).get("choices", []):
            delta = choice.get("delta", {})
            message["content"] += delta.get("content") or ""
            message["reasoning_content"] += delta.get("reasoning_content") or ""
            for call in delta.get("tool_calls") or []:
                slot = message["tool_calls"].setdefault(call["index"], {"name": "", "arguments": ""})
                slot["name"] += call.get("function", {}).get("name") or ""
                slot["arguments"] += call.get("function", {}).get("arguments") or ""
            if choice.get("finish_reason"):
                message["finish_reason"] = choice["finish_reason"]
    return message, plan.finish_reason


def test_thinking_on_gives_reasoning_then_answer(planner: OutputPlanner) -> None:
    msg, reason = run_chat(planner, {"messages": [{"role": "user", "content": "hi"}]})
    assert msg["reasoning_content"] and msg["content"] and not msg["tool_calls"]
    assert "</think>" not in msg["content"] and reason is FinishReason.STOP and msg["finish_reason"] == "stop"


def test_thinking_off_gives_answer_only(planner: OutputPlanner) -> None:
    msg, _ = run_chat(planner, {"messages": [{"role": "user", "content": "hi"}], "thinking": {"type": "disabled"}})
    assert msg["content"] and not msg["reasoning_content"] and "<｜" not in msg["content"]


@pytest.mark.parametrize("thinking", ["enabled", "disabled"])
def test_tools_give_a_dsml_call_of_the_first_tool(planner: OutputPlanner, thinking: str) -> None:
    body = {"messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS, "thinking": {"type": thinking}}
    msg, _ = run_chat(planner, body)
    assert msg["finish_reason"] == "tool_calls"
    (call,) = msg["tool_calls"].values()
    assert call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == {"city": "Paris", "days": 1}
    assert bool(msg["reasoning_content"]) == (thinking == "enabled")


def test_required_tool_choice_continues_the_opened_calls_block(planner: OutputPlanner) -> None:
    body = {
        "messages": [{"role": "user", "content": "weather?"}],
        "tools": TOOLS,
        "tool_choice": "required",
        "thinking": {"type": "disabled"},
    }
    msg, _ = run_chat(planner, body)
    (call,) = msg["tool_calls"].values()
    assert call["name"] == "get_weather" and json.loads(call["arguments"])["city"] == "Paris"


def test_min_tokens_makes_a_call_longer_inside_its_string_argument(planner: OutputPlanner) -> None:
    body = {"messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS, "tool_choice": "required",
            "thinking": {"type": "disabled"}}
    run_chat(planner, body)
    natural = message_tokens[0]
    msg, reason = run_chat(planner, body, min_tokens=natural + 60)
    assert message_tokens[0] >= natural + 60 and reason is FinishReason.STOP
    (call,) = msg["tool_calls"].values()  # still one whole call, and nothing after it
    arguments = json.loads(call["arguments"])
    assert arguments["days"] == 1 and arguments["city"].startswith("Paris") and len(arguments["city"]) > 100
    assert msg["finish_reason"] == "tool_calls" and not msg["content"]


def test_tool_result_turn_is_answered_in_text(planner: OutputPlanner) -> None:
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city":"Paris","days":1}'}}
    body = {
        "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ],
        "tools": TOOLS,
    }
    msg, _ = run_chat(planner, body)
    assert msg["content"].lower().startswith(("based on the tool", "the tool")) and not msg["tool_calls"]


def test_json_schema_output(planner: OutputPlanner) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string"}, "n": {"type": "number"}},
              "required": ["a", "n"]}
    body = {
        "messages": [{"role": "user", "content": "json"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        "thinking": {"type": "disabled"},
    }
    msg, _ = run_chat(planner, body)
    assert json.loads(msg["content"]) == {"a": "example", "n": 1.5}


def test_max_tokens_cuts_with_length(planner: OutputPlanner) -> None:
    msg, reason = run_chat(planner, {"messages": [{"role": "user", "content": "hi"}]}, max_tokens=5)
    assert reason is FinishReason.LENGTH and msg["finish_reason"] == "length"


def test_deterministic_and_ignore_eos(planner: OutputPlanner) -> None:
    prompt = load_tokenizer().tokenizer.encode("<｜User｜>hi<｜Assistant｜></think>")
    a = planner.plan(prompt, Sampling(max_tokens=100, seq_seed=3))
    assert a == planner.plan(prompt, Sampling(max_tokens=100, seq_seed=3))
    assert planner.eos_id not in a.token_ids and a.finish_reason is FinishReason.STOP
    padded = planner.plan(prompt, Sampling(max_tokens=300, ignore_eos=True))
    assert len(padded.token_ids) == 300 and padded.finish_reason is FinishReason.LENGTH
    assert planner.eos_id not in padded.token_ids


def test_regex_best_effort() -> None:
    assert regex_example(r"\d+") == "0"
    assert regex_example(r"yes|no") == "yes"
    assert regex_example(r"[A-Z]{7}") is None


def test_regex_runs_in_linear_time() -> None:
    started = time.monotonic()
    assert regex_example("(.*)*" * 12 + "!") is None  # minutes of backtracking in Python's `re`
    assert regex_example(r"(a)\1") is None  # a backreference: RE2 refuses it, plain text follows
    assert time.monotonic() - started < 1
