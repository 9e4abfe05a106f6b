"""The ext_proc stream of one HTTP request: Envoy's messages in, the EPP's answers out.

Envoy sends the request headers, then the body (`request_body_mode: FULL_DUPLEX_STREAMED`:
the chunks come without waiting for answers), then trailers if any, then the response
phases. The EPP holds its answer to the headers until the body is complete, parses and
prepares it (recipe_bridge, as the front end does), picks, and answers in order: the headers
(`x-gateway-destination-endpoint: ip:port[,fallbacks]` set and `clear_route_cache`; the same
value as dynamic metadata under `envoy.lb`), the body as it came, in chunks, and the
trailers. A request it cannot serve ends in an `ImmediateResponse` in the client protocol's
error JSON: 404/405 at the headers for anything but a client API (client_routes.py: the
worker protocol is never routed), 400 for a bad body, 413 for one over the limit, 503 when
no endpoint is eligible, 429 when admission sheds it.

The subset hint (the endpoints the data plane allows) is read from the `envoy.lb.subset_hint`
metadata the data plane sets; the same-named request header is a client's to send, so it
counts only where the deployment says its data plane owns that header (`--subset-hint-header`).

With `request_body_mode: BUFFERED` instead (what a fail-open data plane needs: Envoy 1.40
fails a FULL_DUPLEX_STREAMED request closed when the EPP is unreachable after its body went
out), the headers are answered at once and the route goes with the answer to the whole
body, which Envoy holds the headers for.

The response phases end the request's booked load: the response headers (its prompt no
longer queued; the served endpoint, where the data plane reports it, takes the load), each
body chunk (read for the engine's cached-token figure, passed on unchanged), and the last
chunk, trailers or the stream's close, whichever comes first (a client that leaves resets
the stream).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

import orjson
from envoy.config.core.v3 import base_pb2 as core
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from deepinfer_gateway.config import GatewaySettings
from deepinfer_gateway.core import headers as names
from deepinfer_gateway.core.errors import GatewayError, InternalError
from deepinfer_gateway.core.session_identity import identity_from, scoped
from deepinfer_gateway.epp.bodies import UsageScanner, path_protocol
from deepinfer_gateway.epp.client_routes import client_route_refusal
from deepinfer_gateway.epp.metrics import EppMetrics
from deepinfer_gateway.epp.picker import EndpointPicker, Pick, endpoint_of
from deepinfer_gateway.gateway.fleet.client_ids import client_worker_id
from deepinfer_gateway.gateway.serving.error_json import client_protocol, error_payload
from deepinfer_gateway.gateway.serving.service_tier import epp_flow_ticket
from deepinfer_gateway.recipe_bridge.prepare import RequestPreparer
from deepinfer_gateway.recipe_bridge.prepared import ApiProtocol, PreparedRequest

log = logging.getLogger(__name__)

EPP_SCOPE = "epp"  # the one scope of the sessions the EPP sees (session_identity.scoped)

DESTINATION = "x-gateway-destination-endpoint"
SUBSET = "x-gateway-destination-endpoint-subset"
SERVED = "x-gateway-destination-endpoint-served"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
BODY_CHUNK = 64 * 1024  # bytes per streamed body answer: well under gRPC's 4 MiB message limit
_OVERWRITE = core.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
_NO_BODY = processing_mode_pb2.ProcessingMode.NONE


def _header(key: str, value: str) -> core.HeaderValueOption:
    return core.HeaderValueOption(header=core.HeaderValue(key=key, raw_value=value.encode()), append_action=_OVERWRITE)


def header_map(headers: core.HeaderMap) -> dict[str, str]:
    """Envoy's header list as a dict (it sends `raw_value`; `value` from older data planes)."""
    return {h.key.lower(): h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value for h in headers.headers}


def _metadata_value(metadata: core.Metadata, namespace: str, key: str) -> Any:
    if namespace not in metadata.filter_metadata:
        return None
    fields = metadata.filter_metadata[namespace].fields
    if key not in fields:
        return None
    value = fields[key]
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        return [v.string_value for v in value.list_value.values]
    if kind == "string_value":
        return value.string_value
    return None


def subset_hint(metadata: core.Metadata, headers: Mapping[str, str], header_allowed: bool = False
                ) -> frozenset[str] | None:
    """The endpoints the data plane allows (its metadata; then the header, where `header_allowed`:
    a client can send that header, so by default it pins nothing); None: the whole pool."""
    listed = _metadata_value(metadata, SUBSET_NAMESPACE, SUBSET)
    if listed is None and header_allowed and SUBSET in headers:
        listed = headers[SUBSET]
    if listed is None:
        return None
    if isinstance(listed, str):
        listed = listed.split(",")
    return frozenset(e.strip() for e in listed if e.strip())


def route_answer(pick: Pick, *, in_body: bool = False) -> pb.ProcessingResponse:
    """The pick as header and `envoy.lb` metadata: the headers' answer, or (`in_body`: a buffered
    body) the body's, whose header mutation applies to the headers Envoy still holds."""
    value = pick.header
    metadata = struct_pb2.Struct()
    metadata.update({LB_NAMESPACE: {DESTINATION: value}})
    common = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=[_header(DESTINATION, value)]),
                               clear_route_cache=True)
    if in_body:
        return pb.ProcessingResponse(request_body=pb.BodyResponse(response=common), dynamic_metadata=metadata)
    return pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common), dynamic_metadata=metadata)


def body_answers(body: bytes, end_of_stream: bool) -> list[pb.ProcessingResponse]:
    """The body handed back in order, in chunks (FULL_DUPLEX_STREAMED: the data plane sends what we send)."""
    chunks = [body[i:i + BODY_CHUNK] for i in range(0, len(body), BODY_CHUNK)] or [b""]
    last = len(chunks) - 1
    return [pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
        body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
            body=chunk, end_of_stream=end_of_stream and i == last)))))
        for i, chunk in enumerate(chunks)]


def refusal(protocol: ApiProtocol | None, error: GatewayError) -> pb.ProcessingResponse:
    """An `ImmediateResponse`: the error JSON the client's protocol reads, with the error's headers."""
    status = error.status_code
    body = orjson.dumps(error_payload(protocol, status, error.message, error.param, error.code))
    headers = [_header("content-type", "application/json")] + [_header(k, v) for k, v in error.headers.items()]
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status),
        headers=pb.HeaderMutation(set_headers=headers), body=body, details=f"epp_refused_{status}"))


class RequestStream:
    """One HTTP request's ext_proc exchange (module doc)."""

    def __init__(self, service: EndpointPickerService):
        self.service = service
        self.arrival = time.perf_counter()
        self.headers: dict[str, str] = {}
        self.path = ""
        self.protocol: ApiProtocol | None = None
        self.request_id = ""
        self.subset: frozenset[str] | None = None
        self.body: list[bytes] = []
        self.body_bytes = 0
        self.prepared: PreparedRequest | None = None
        self.pick: Pick | None = None
        self.refused = False
        self.status = ""
        self.scanner = UsageScanner()
        self.first_chunk_at: float | None = None
        self.finished = False
        self.duplex = True  # FULL_DUPLEX_STREAMED request body; False: BUFFERED
        self.reads_response = True  # the response body comes (not `response_body_mode: NONE`)

    @property
    def model(self) -> str:
        return self.prepared.model if self.prepared is not None else "unknown"

    async def handle(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        phase = message.WhichOneof("request")
        if self.refused:
            return []
        try:
            if phase == "request_headers":
                return await self._request_headers(message)
            if phase == "request_body":
                return await self._request_body(message.request_body)
            if phase == "request_trailers":
                answers = [] if self.pick is not None else await self._route(end_of_stream=False)
                if self.refused:
                    return answers
                return [*answers, pb.ProcessingResponse(request_trailers=pb.TrailersResponse())]
            if phase == "response_headers":
                return await self._response_headers(message)
            if phase == "response_body":
                return await self._response_body(message.response_body)
            if phase == "response_trailers":
                self.finish()
                return [pb.ProcessingResponse(response_trailers=pb.TrailersResponse())]
        except GatewayError as exc:
            return [self._refuse(exc)]
        except Exception:
            log.exception("request %s: the EPP failed on %s", self.request_id, phase)
            return [self._refuse(InternalError())]
        return []

    async def _request_headers(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        self.headers = header_map(message.request_headers.headers)
        self.path = self.headers.get(":path", "")
        self.protocol = path_protocol(self.path)
        self.request_id = self.headers.get(names.REQUEST_ID) or uuid.uuid4().hex
        refused = client_route_refusal(self.headers.get(":method", ""), self.path)
        if refused is not None:
            self.protocol = None
            raise refused
        self.subset = subset_hint(message.metadata_context, self.headers, self.service.subset_hint_header)
        if message.HasField("protocol_config"):
            self.duplex = message.protocol_config.request_body_mode == _DUPLEX
            self.reads_response = message.protocol_config.response_body_mode != _NO_BODY
        if message.request_headers.end_of_stream:
            self.protocol = None  # no body to read
            return await self._route(end_of_stream=None)
        if not self.duplex:  # Envoy sends the buffered body once the headers are answered
            return [pb.ProcessingResponse(request_headers=pb.HeadersResponse())]
        return []

    async def _request_body(self, body: pb.HttpBody) -> list[pb.ProcessingResponse]:
        if body.body:
            self.body.append(body.body)
            self.body_bytes += len(body.body)
            limit = self.service.settings.max_body_bytes
            if self.body_bytes > limit:
                raise GatewayError(f"Request body larger than {limit} bytes.", status_code=413)
        if body.end_of_stream or not self.duplex:  # a buffered body comes whole, in one message
            return await self._route(end_of_stream=True)
        return []

    async def _route(self, end_of_stream: bool | None) -> list[pb.ProcessingResponse]:
        """Prepare, pick and answer the request phases held so far (`end_of_stream` None: no body)."""
        service = self.service
        body = b"".join(self.body)
        if self.protocol is not None:
            self.prepared = await service.preparer.prepare_async(self.protocol, body)
        # No API key here (Envoy authenticates): sessions are keyed in one scope of the EPP's own.
        session = scoped(identity_from(self.headers, self.prepared.user if self.prepared else None), EPP_SCOPE)
        flow = epp_flow_ticket(service.settings.flow_control, self.headers, self.prepared) if self.prepared else None
        self.pick = await service.picker.pick(self.prepared, self.subset, self.request_id, session, flow,
                                              self.arrival)
        if end_of_stream is not None and not self.duplex:
            return [route_answer(self.pick, in_body=True)]
        answers = [route_answer(self.pick)]
        if end_of_stream is not None:
            answers += body_answers(body, end_of_stream)
        self.body = []
        return answers

    async def _response_headers(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        headers = header_map(message.response_headers.headers)
        self.status = headers.get(":status", "")
        mutation = pb.HeaderMutation(remove_headers=[SERVED])
        if self.pick is not None:
            served = _metadata_value(message.metadata_context, LB_NAMESPACE, SERVED) or headers.get(SERVED)
            if isinstance(served, str) and served:
                worker = self.service.picker.by_endpoint(served.strip())
                if worker is not None:
                    self.pick.booking.move(worker)
            # The worker as clients see it (its id, or a digest of its address): never the address.
            mutation.set_headers.append(_header(names.WORKER, client_worker_id(self.pick.booking.worker.spec)))
        answer = pb.ProcessingResponse(response_headers=pb.HeadersResponse(
            response=pb.CommonResponse(header_mutation=mutation)))
        if message.response_headers.end_of_stream:
            if self.pick is not None:
                self.pick.on_ready()
            self.finish()
        return [answer]

    async def _response_body(self, body: pb.HttpBody) -> list[pb.ProcessingResponse]:
        if self.first_chunk_at is None and body.body:
            self.first_chunk_at = time.perf_counter()
            if self.pick is not None:
                self.pick.on_ready()
        self.scanner.feed(body.body)
        if body.end_of_stream:
            self.finish()
        return [pb.ProcessingResponse(response_body=pb.BodyResponse())]

    def _refuse(self, error: GatewayError) -> pb.ProcessingResponse:
        self.refused = True
        self.finished = True  # counted here, once: the stream's close is not a client leaving
        protocol = self.protocol or client_protocol(self.path, self.headers)
        self.service.metrics.gateway.count_request(str(self.protocol or "other"), self.model, error.status_code)
        if self.pick is not None:
            self.pick.end()
        return refusal(protocol, error)

    def finish(self, client_left: bool = False) -> None:
        """The request's end, once: its load released, its outcome counted."""
        if self.finished or self.pick is None:
            return
        self.finished = True
        pick, metrics = self.pick, self.service.metrics.gateway
        pick.end()
        if client_left:
            metrics.client_disconnects.inc()
        status = "499" if client_left else (self.status or "502")
        if self.protocol is not None:
            metrics.count_request(str(self.protocol), self.model, status)
        prepared = self.prepared
        if prepared is None:
            return
        worker = pick.booking.worker
        series = metrics.request_series(prepared.model, worker.pool, str(worker.spec.hardware))
        now = time.perf_counter()
        if prepared.stream and self.first_chunk_at is not None:
            series.ttft.observe(self.first_chunk_at - self.arrival)
        series.duration.observe(now - self.arrival)
        series.prompt_len.observe(prepared.prompt_tokens)
        if status != "200" or self.scanner.cached is None:
            return
        reported = self.scanner.cached
        predicted = pick.plan.decision.predicted_memory_tokens + pick.plan.decision.predicted_store_tokens
        metrics.prompt_tokens.inc(prepared.prompt_tokens)
        if reported:
            metrics.cached_tokens.labels("memory").inc(reported)
        if pick.plan.decision.predicted_memory_tokens:
            metrics.predicted_cached_tokens.labels("memory").inc(pick.plan.decision.predicted_memory_tokens)
        if pick.plan.decision.predicted_store_tokens:
            metrics.predicted_cached_tokens.labels("store").inc(pick.plan.decision.predicted_store_tokens)
        metrics.prediction_error.observe((predicted - reported) / max(prepared.prompt_tokens, 1))


class EndpointPickerService(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]  # generated, untyped
    """envoy.service.ext_proc.v3.ExternalProcessor: one `RequestStream` per HTTP request."""

    def __init__(self, picker: EndpointPicker, preparer: RequestPreparer, metrics: EppMetrics,
                 settings: GatewaySettings, subset_hint_header: bool = False):
        self.picker = picker
        self.preparer = preparer
        self.metrics = metrics
        self.settings = settings
        self.subset_hint_header = subset_hint_header  # the deployment's data plane owns that request header

    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest],
                      context: Any) -> AsyncIterator[pb.ProcessingResponse]:
        stream = RequestStream(self)
        phases = self.metrics.phases
        try:
            async for message in request_iterator:
                started = time.perf_counter()
                answers = await stream.handle(message)
                phases[message.WhichOneof("request")].observe(time.perf_counter() - started)
                for answer in answers:
                    yield answer
        finally:
            # The stream closed before the response's end: the client left or the data plane gave up.
            # Without the response body (`response_body_mode: NONE`) the close is the only end there is.
            stream.finish(client_left=not stream.finished and (stream.reads_response or not stream.status))


__all__ = ["EndpointPickerService", "RequestStream", "endpoint_of"]
