"""The EPP's pure readers: the cached-token figure of any protocol's usage, fed in arbitrary
chunks; the subset hint from metadata or header; the endpoint of a worker URL."""

from __future__ import annotations

import orjson
import pytest
from envoy.config.core.v3 import base_pb2 as core
from google.protobuf import struct_pb2

from deepinfer_gateway.epp.bodies import UsageScanner, path_protocol
from deepinfer_gateway.epp.extproc import subset_hint
from deepinfer_gateway.epp.picker import endpoint_of
from deepinfer_gateway.recipe_bridge.prepared import ApiProtocol

OPENAI = orjson.dumps({"usage": {"prompt_tokens": 900, "prompt_tokens_details": {"cached_tokens": 768}}})
ANTHROPIC_STREAM = (b'event: message_start\ndata: {"type":"message_start","message":{"usage":'
                    b'{"input_tokens":12,"cache_read_input_tokens": 512}}}\n\n'
                    b'event: content_block_delta\ndata: {"type":"content_block_delta"}\n\n')


@pytest.mark.parametrize(("body", "cached"), [(OPENAI, 768), (ANTHROPIC_STREAM, 512), (b'{"usage": {}}', None)])
@pytest.mark.parametrize("size", [1, 7, 64, 100_000])
def test_usage_scanner_reads_the_figure_whatever_the_chunking(body: bytes, cached: int | None, size: int) -> None:
    scanner = UsageScanner()
    for i in range(0, len(body), size):
        scanner.feed(body[i:i + size])
    assert scanner.cached == cached


def test_usage_scanner_keeps_the_last_figure() -> None:
    scanner = UsageScanner()
    scanner.feed(b'data: {"usage":{"prompt_tokens_details":{"cached_tokens":0}}}\n\n')
    scanner.feed(b"x" * 500 + b'data: {"usage":{"prompt_tokens_details":{"cached_tokens":384}}}\n\n')
    assert scanner.cached == 384


def test_subset_hint_from_metadata_then_the_header_where_allowed() -> None:
    metadata = core.Metadata()
    hint = struct_pb2.Struct()
    hint.update({"x-gateway-destination-endpoint-subset": ["10.0.0.1:8000", "10.0.0.2:8000"]})
    metadata.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    header = {"x-gateway-destination-endpoint-subset": "10.0.0.9:8000"}
    assert subset_hint(metadata, header, header_allowed=True) == frozenset({"10.0.0.1:8000", "10.0.0.2:8000"})
    assert subset_hint(core.Metadata(), header) is None  # a client sent it: it pins nothing by default
    assert subset_hint(core.Metadata(), header, header_allowed=True) == frozenset({"10.0.0.9:8000"})
    spaced = {"x-gateway-destination-endpoint-subset": " a:1, b:2 ,"}
    assert subset_hint(core.Metadata(), spaced, header_allowed=True) == frozenset({"a:1", "b:2"})
    assert subset_hint(core.Metadata(), {}, header_allowed=True) is None


def test_endpoint_and_protocol_of() -> None:
    assert endpoint_of("http://10.1.2.3:8100") == "10.1.2.3:8100"
    assert endpoint_of("https://10.1.2.3") == "10.1.2.3:443"
    assert endpoint_of("http://[fd00::1]:8000/") == "[fd00::1]:8000"
    assert path_protocol("/v1/messages?beta=true") is ApiProtocol.MESSAGES
    assert path_protocol("/v1/models") is None
