"""Drive a real `deepinfer-gateway epp` over its ext_proc gRPC stream as Envoy's ext_proc filter
does (FULL_DUPLEX_STREAMED request body): the request headers, the body, then the response
phases, one HTTP request per stream; no Envoy in between, so a test reads every answer."""

from __future__ import annotations

import queue
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import grpc
import orjson
from envoy.config.core.v3 import base_pb2 as core
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2

DESTINATION = "x-gateway-destination-endpoint"
SUBSET = "x-gateway-destination-endpoint-subset"


def _headers(pairs: Mapping[str, str]) -> core.HeaderMap:
    return core.HeaderMap(headers=[core.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()])


@dataclass
class Answer:
    """What the EPP answered a request: its pick (endpoints in preference order), or a refusal."""

    endpoints: list[str]
    status: int | None = None  # an ImmediateResponse's status
    body: dict[str, object] | None = None
    headers: dict[str, str] | None = None


class ExtProcClient:
    def __init__(self, port: int):
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.stub = pb_grpc.ExternalProcessorStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def request(self, path: str, body: object = None, *, method: str = "POST",
                headers: Mapping[str, str] | None = None, subset_metadata: list[str] | None = None) -> Answer:
        """One request through the stream; a routed one is then answered 200 with a first body
        chunk and ended, so the EPP releases the load it booked."""
        sent: queue.Queue[pb.ProcessingRequest | None] = queue.Queue()
        replies: Iterator[pb.ProcessingResponse] = self.stub.Process(iter(sent.get, None), timeout=30)
        try:
            metadata = core.Metadata()
            if subset_metadata is not None:
                hint = struct_pb2.Struct()
                hint.update({SUBSET: subset_metadata})
                metadata.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
            data = b"" if body is None else orjson.dumps(body)
            pairs = {":method": method, ":path": path, ":authority": "epp.test", "content-type": "application/json",
                     **(headers or {})}
            sent.put(pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=_headers(pairs),
                                                                         end_of_stream=not data),
                                          metadata_context=metadata))
            if data:
                sent.put(pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=True)))
            first = next(replies)
            if first.HasField("immediate_response"):
                refusal = first.immediate_response
                return Answer([], refusal.status.code, orjson.loads(refusal.body),
                              {h.header.key: h.header.raw_value.decode() for h in refusal.headers.set_headers})
            (route,) = [h.header.raw_value.decode() for h in first.request_headers.response.header_mutation.set_headers
                        if h.header.key == DESTINATION]
            if data:  # the body handed back, to its last chunk
                while not next(replies).request_body.response.body_mutation.streamed_response.end_of_stream:
                    pass
            sent.put(pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=_headers({":status": "200"}))))
            next(replies)
            sent.put(pb.ProcessingRequest(response_body=pb.HttpBody(body=b"{}", end_of_stream=True)))
            next(replies)
            return Answer(route.split(","))
        finally:
            sent.put(None)
            replies.cancel()  # type: ignore[attr-defined]  # a grpc call object
