"""OpenAI/SGLang-compatible endpoints on a sim worker, so third-party routers (SGLang's
and vLLM's routers, LiteLLM) can be benchmarked against the very same cluster.

Chat requests go through deepseek-recipe directly (convert, StreamProcessor for the
output) and the gateway's segment-cached V4.1 prompt encoder, then through the same
engine, prefix cache and KV store as worker-protocol requests;
`usage.prompt_tokens_details.cached_tokens` is the engine's memory + store hit.
Anthropic Messages (`/v1/messages`) go through the gateway's own bridge (recipe_bridge's
`RequestPreparer` and `ResponseStream`), so an Envoy + EPP in front of sim workers serves the
Anthropic SDK as the gateway does. Text completions and SGLang `/generate` take a prompt
string (plain tokenizer encoding) or token ids, and return text from the sim's detokenizer. Not a full OpenAI
implementation: n=1, no logprobs, no stop strings.

Peer routers render or tokenize every request, on every worker, before sending it (vLLM's
router calls `/v1/chat/completions/render` on each), so the encoder is shared by all the
workers of a process: one worker tokenizes a prompt; the others, and the chat request that
follows, read its segments from the cache. A client that leaves while its body is being
read (a router abandoning a render) gets no answer and leaves no traceback.
"""

from __future__ import annotations

import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from functools import cached_property
from hashlib import blake2b
from pathlib import Path
from typing import Any

import orjson
from deepseek_recipe import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ConversationRequest,
    ConversionError,
    ConversionOptions,
    InferenceChunk,
    InferenceFinishReason,
    PromptUsage,
    StreamProcessor,
)
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from deepinfer_gateway.core.errors import BridgeError, GatewayError
from deepinfer_gateway.core.protocol import GenerateRequest, Sampling
from deepinfer_gateway.recipe_bridge.conversion import min_tokens_of, sampling_of
from deepinfer_gateway.recipe_bridge.detokenizer import token_bytes
from deepinfer_gateway.recipe_bridge.encoder import PromptEncoder
from deepinfer_gateway.recipe_bridge.prepare import RequestPreparer
from deepinfer_gateway.recipe_bridge.prepared import ApiProtocol, BridgeConfig, PreparedRequest
from deepinfer_gateway.recipe_bridge.stream import ResponseStream
from deepinfer_gateway.recipe_bridge.tokenizer import TokenizerBundle, write_tokenizer_dir
from deepinfer_gateway.workers.server import json_response
from deepinfer_gateway.workers.sim.engine import SimEngine

SSE = "text/event-stream"
_RECIPE_FINISH = {"stop": InferenceFinishReason.Stop, "length": InferenceFinishReason.Length}
CLIENT_GONE = 499  # the status nobody reads: the client left before its body arrived
_ENCODER_CACHE_BYTES = 64 * 1024 * 1024  # a sim process's share: recent prompts, not a fleet's history
_ENCODERS: dict[str, PromptEncoder] = {}


def shared_encoder(bundle: TokenizerBundle) -> PromptEncoder:
    """One segment-cached encoder per tokenizer.json and process, shared by every worker in it."""
    encoder = _ENCODERS.get(bundle.json_text)
    if encoder is None:
        encoder = _ENCODERS.setdefault(bundle.json_text, PromptEncoder(bundle, cache_bytes=_ENCODER_CACHE_BYTES))
    return encoder


def tokenizer_dir(bundle: TokenizerBundle) -> Path:
    """A local directory holding tokenizer.json, for routers that read `model_path`."""
    digest = blake2b(bundle.json_text.encode(), digest_size=8).hexdigest()
    directory = Path(tempfile.gettempdir()) / f"deepinfer-sim-tokenizer-{digest}"
    if not (directory / "tokenizer.json").exists():
        write_tokenizer_dir(bundle, directory)
    return directory


def _error(status: int, message: str, kind: str = "invalid_request_error") -> Response:
    return json_response({"error": {"message": message, "type": kind, "code": status}}, status)


def _sse(payload: str | bytes) -> bytes:
    return b"data: " + (payload.encode() if isinstance(payload, str) else payload) + b"\n\n"


class CompatLayer:
    def __init__(self, engine: SimEngine, bundle: TokenizerBundle, model: str) -> None:
        self.engine = engine
        self.bundle = bundle
        self.model = model

    @cached_property
    def model_dir(self) -> str:
        return str(tokenizer_dir(self.bundle))

    # --- prompts ----------------------------------------------------------------------

    def convert_chat(self, body: dict[str, Any]) -> tuple[ConversationRequest, list[int]]:
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is not None:
            # deepseek-recipe reads only `max_tokens`; SGLang's router forwards the newer name.
            body = {**body, "max_tokens": body["max_completion_tokens"]}
        conv = ChatCompletionRequest(body).convert(ConversionOptions())
        return conv, self.encoder.encode(conv.conversation)

    @cached_property
    def encoder(self) -> PromptEncoder:
        return shared_encoder(self.bundle)

    @cached_property
    def preparer(self) -> RequestPreparer:
        return RequestPreparer(self.encoder, BridgeConfig(model_names=(self.model,),
                                                          context_limit=self.engine.profile.max_model_len))

    def chat_sampling(self, conv: ConversationRequest, prompt_len: int, ignore_eos: bool = False,
                      min_tokens: Any = None) -> Sampling:
        """The engine's sampling for a converted chat request, as the gateway builds it, with the
        vLLM/SGLang extensions it honours too (benchmarks): `ignore_eos`, `min_tokens`
        (BridgeError: a bad one). No logprobs: this endpoint does not return them."""
        max_tokens = max(1, conv.resolve_max_tokens(prompt_len, self.engine.profile.max_model_len))
        return sampling_of(conv, max_tokens, ignore_eos, min_tokens_of(min_tokens, max_tokens), logprobs=(False, 0))

    def text_prompt(self, prompt: Any) -> list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            return [int(t) for t in prompt]
        if isinstance(prompt, list):
            prompt = prompt[0] if prompt else ""
        return list(self.bundle.tokenizer.encode(str(prompt)))

    def decode(self, ids: list[int]) -> str:
        return token_bytes(self.bundle.json_text).decode(ids)

    # --- generation -------------------------------------------------------------------

    async def events(self, token_ids: list[int], sampling: Sampling) -> AsyncIterator[dict[str, Any]]:
        request = GenerateRequest(request_id=uuid.uuid4().hex, token_ids=token_ids, sampling=sampling)
        events = self.engine.generate(request)
        try:
            async for event in events:
                yield event
        finally:
            await events.aclose()

    async def frames(self, prepared: PreparedRequest) -> AsyncIterator[bytes]:
        """A prepared request's answer in its protocol's framing (SSE events, or the parts of one body)."""
        out = ResponseStream(prepared, self.bundle, "msg_" + uuid.uuid4().hex)
        async for event in self.events(list(prepared.token_ids), prepared.sampling):
            kind = event["event"]
            if kind == "ready":
                cached = event["cached_tokens"]
                yield out.ready(event["prompt_tokens"], cached["memory"] + cached["store"])
            elif kind == "tokens":
                yield out.tokens(event["token_ids"])
            elif event["reason"] in _RECIPE_FINISH:
                yield out.finish(event["reason"])
            else:
                raise RuntimeError(event.get("error", {}).get("message", event["reason"]))
        if not prepared.stream:
            yield out.body()

    async def chat_chunks(self, conv: ConversationRequest, prompt: list[int], rid: str,
                          sampling: Sampling) -> AsyncIterator[Any]:
        proc = StreamProcessor(ChatCompletionRequest.chunk_generator(conv, rid, self.model), conv.parsing_options,
                               self.bundle.tokenizer)
        try:
            async for event in self.events(prompt, sampling):
                kind = event["event"]
                if kind == "ready":
                    cached = event["cached_tokens"]["memory"] + event["cached_tokens"]["store"]
                    usage = PromptUsage(prompt_tokens=event["prompt_tokens"], prompt_cache_hit_tokens=cached)
                    chunk = InferenceChunk.ready(prompt_usage=usage)
                elif kind == "tokens":
                    chunk = InferenceChunk.tokens(event["token_ids"])
                elif event["reason"] in _RECIPE_FINISH:
                    chunk = InferenceChunk.finish(_RECIPE_FINISH[event["reason"]])
                else:
                    raise RuntimeError(event.get("error", {}).get("message", event["reason"]))
                for out in proc.push(chunk):
                    yield out
            for out in proc.finish():
                yield out
        finally:
            proc.close()


def compat_router(engine: SimEngine, bundle: TokenizerBundle, model: str) -> APIRouter:
    layer = CompatLayer(engine, bundle, model)
    router = APIRouter()

    async def body_of(request: Request) -> dict[str, Any] | Response:
        try:
            body = orjson.loads(await request.body())
        except ClientDisconnect:
            return Response(status_code=CLIENT_GONE)
        except orjson.JSONDecodeError:
            return _error(400, "body is not JSON")
        return body if isinstance(body, dict) else _error(400, "body must be a JSON object")

    @router.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await body_of(request)
        if isinstance(body, Response):
            return body
        try:
            conv, prompt = layer.convert_chat(body)
            sampling = layer.chat_sampling(conv, len(prompt), body.get("ignore_eos") is True, body.get("min_tokens"))
        except ConversionError as err:
            return Response(err.body, status_code=err.status_code, media_type="application/json")
        except BridgeError as err:
            return _error(err.status_code, str(err))
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if body.get("stream"):

            async def stream() -> AsyncIterator[bytes]:
                try:
                    async for chunk in layer.chat_chunks(conv, prompt, rid, sampling):
                        yield _sse(chunk.to_json())
                except RuntimeError as err:
                    yield _sse(orjson.dumps({"error": {"message": str(err), "type": "server_error"}}))
                yield _sse(ChatCompletionResponse.sse_done_data() or "[DONE]")

            return StreamingResponse(stream(), media_type=SSE)
        response: ChatCompletionResponse | None = None
        try:
            async for chunk in layer.chat_chunks(conv, prompt, rid, sampling):
                if response is None:
                    response = ChatCompletionResponse(rid, layer.model, created, len(prompt), 0)
                response.accumulate(chunk)
        except RuntimeError as err:
            return _error(503, str(err), "server_error")
        assert response is not None
        return Response(response.to_json(), media_type="application/json")

    @router.post("/v1/messages")
    async def messages(request: Request) -> Response:
        try:
            prepared = layer.preparer.prepare(ApiProtocol.MESSAGES, await request.body())
        except ClientDisconnect:
            return Response(status_code=CLIENT_GONE)
        except GatewayError as err:
            body = {"type": "error", "error": {"type": "invalid_request_error", "message": err.message}}
            return Response(orjson.dumps(body), status_code=err.status_code, media_type="application/json")
        if prepared.stream:
            return StreamingResponse(layer.frames(prepared), media_type=SSE)
        parts = [part async for part in layer.frames(prepared)]
        return Response(parts[-1], media_type="application/json")

    async def complete(token_ids: list[int], sampling: Sampling) -> dict[str, Any]:
        out: list[int] = []
        result: dict[str, Any] = {"prompt_tokens": len(token_ids), "cached": 0, "reason": "stop"}
        async for event in layer.events(token_ids, sampling):
            if event["event"] == "ready":
                result["cached"] = event["cached_tokens"]["memory"] + event["cached_tokens"]["store"]
            elif event["event"] == "tokens":
                out.extend(event["token_ids"])
            else:
                result["reason"] = event["reason"]
        result["ids"] = out
        return result

    def usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await body_of(request)
        if isinstance(body, Response):
            return body
        try:
            ids = layer.text_prompt(body.get("prompt", ""))
            sampling = Sampling(max_tokens=int(body.get("max_tokens") or 16), seq_seed=body.get("seed"),
                                ignore_eos=bool(body.get("ignore_eos", False)))
        except (ValidationError, TypeError, ValueError) as err:
            return _error(400, str(err))
        if not ids:
            return _error(400, "prompt is empty")
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "object": "text_completion", "created": created, "model": layer.model}
        if body.get("stream"):

            async def stream() -> AsyncIterator[bytes]:
                cached, n = 0, 0
                async for event in layer.events(ids, sampling):
                    if event["event"] == "ready":
                        cached = event["cached_tokens"]["memory"] + event["cached_tokens"]["store"]
                    elif event["event"] == "tokens":
                        n += len(event["token_ids"])
                        choice = {"index": 0, "text": layer.decode(event["token_ids"]), "finish_reason": None}
                        yield _sse(orjson.dumps({**base, "choices": [choice]}))
                    else:
                        final = {"index": 0, "text": "", "finish_reason": event["reason"]}
                        yield _sse(orjson.dumps({**base, "choices": [final], "usage": usage(len(ids), n, cached)}))
                yield _sse("[DONE]")

            return StreamingResponse(stream(), media_type=SSE)
        r = await complete(ids, sampling)
        choice = {"index": 0, "text": layer.decode(r["ids"]), "finish_reason": r["reason"], "logprobs": None}
        return json_response({**base, "choices": [choice], "usage": usage(len(ids), len(r["ids"]), r["cached"])})

    @router.post("/generate")
    async def sglang_generate(request: Request) -> Response:
        body = await body_of(request)
        if isinstance(body, Response):
            return body
        params = body.get("sampling_params") or {}
        try:
            ids = layer.text_prompt(body["input_ids"] if body.get("input_ids") else body.get("text", ""))
            sampling = Sampling(max_tokens=int(params.get("max_new_tokens") or 128),
                                ignore_eos=bool(params.get("ignore_eos", False)))
        except (ValidationError, TypeError, ValueError) as err:
            return _error(400, str(err))
        if not ids:
            return _error(400, "text or input_ids is required")
        rid = body.get("rid") or uuid.uuid4().hex

        def meta(n: int, cached: int, reason: str | None) -> dict[str, Any]:
            finish = {"type": reason} if reason else None
            return {"id": rid, "prompt_tokens": len(ids), "completion_tokens": n, "cached_tokens": cached,
                    "finish_reason": finish}

        if body.get("stream"):

            async def stream() -> AsyncIterator[bytes]:
                out: list[int] = []
                cached = 0
                async for event in layer.events(ids, sampling):
                    if event["event"] == "ready":
                        cached = event["cached_tokens"]["memory"] + event["cached_tokens"]["store"]
                        continue
                    reason = event.get("reason") if event["event"] == "finish" else None
                    out.extend(event.get("token_ids", []))
                    payload = {"text": layer.decode(out), "output_ids": out,
                               "meta_info": meta(len(out), cached, reason)}
                    yield _sse(orjson.dumps(payload))
                yield _sse("[DONE]")

            return StreamingResponse(stream(), media_type=SSE)
        r = await complete(ids, sampling)
        return json_response({"text": layer.decode(r["ids"]), "output_ids": r["ids"],
                              "meta_info": meta(len(r["ids"]), r["cached"], r["reason"])})

    # --- discovery, load, tokenization ------------------------------------------------

    def server_info() -> dict[str, Any]:
        path = layer.model_dir
        mode = {"prefill": "prefill", "decode": "decode"}.get(str(engine.role), "null")
        profile = engine.profile
        return {
            "served_model_name": model,
            "model_path": path,
            "tokenizer_path": path,
            "dp_size": profile.dp_ranks,
            "tp_size": max(1, int(profile.gpus_per_rank)),
            "disaggregation_mode": mode,
            "max_total_num_tokens": profile.memory_capacity_blocks * 128,
            "context_length": profile.max_model_len,
            "version": "deepinfer-sim",
        }

    def model_info() -> dict[str, Any]:
        path = layer.model_dir
        return {"model_path": path, "tokenizer_path": path, "is_generation": True, "served_model_name": model}

    for path in ("/server_info", "/get_server_info"):
        router.add_api_route(path, lambda: json_response(server_info()), methods=["GET"])
    for path in ("/model_info", "/get_model_info"):
        router.add_api_route(path, lambda: json_response(model_info()), methods=["GET"])

    @router.get("/health_generate")
    async def health_generate() -> Response:
        return json_response({"status": "ok"})

    @router.get("/v1/models")
    async def models() -> Response:
        card = {"id": model, "object": "model", "created": 0, "owned_by": "deepinfer-sim",
                "max_model_len": engine.profile.max_model_len}
        return json_response({"object": "list", "data": [card]})

    @router.get("/get_load")
    async def get_load() -> Response:
        return json_response(
            [
                {"dp_rank": r.dp_rank, "num_reqs": r.running, "num_waiting_reqs": r.waiting,
                 "num_tokens": r.queued_prefill_tokens}
                for r in engine.load().dp_ranks
            ]
        )

    async def render(request: Request, chat_body: bool) -> Response:
        body = await body_of(request)
        if isinstance(body, Response):
            return body
        if chat_body or "messages" in body:
            try:
                _, ids = layer.convert_chat({"model": model, **body})
            except ConversionError as err:
                return Response(err.body, status_code=err.status_code, media_type="application/json")
        else:
            ids = layer.text_prompt(body.get("prompt", body.get("text", "")))
        # The ids under each name routers read (SGLang/vLLM `tokens`, vLLM render `token_ids`), encoded once.
        encoded = orjson.dumps(ids)
        tail = orjson.dumps({"count": len(ids), "max_model_len": engine.profile.max_model_len})
        payload = b'{"tokens":%s,"token_ids":%s,"prompt_token_ids":%s,%s' % (encoded, encoded, encoded, tail[1:])
        return Response(payload, media_type="application/json")

    @router.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await render(request, chat_body=False)

    @router.post("/v1/chat/completions/render")
    async def render_chat(request: Request) -> Response:
        return await render(request, chat_body=True)

    @router.post("/v1/completions/render")
    async def render_completion(request: Request) -> Response:
        return await render(request, chat_body=False)

    return router
