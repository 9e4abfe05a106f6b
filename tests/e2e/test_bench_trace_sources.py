"""Published traces by name: download once over real HTTP (a loopback mirror), verify, cache.

The mirror serves files under the raw.githubusercontent.com layout
(`/<owner>/<repo>/<commit>/<path>`). Where the shared copies are byte-identical to the
published files (Mooncake synthetic, both Azure CSVs), the registry's real pinned digests
are checked against them; the rest uses generated files.
"""

from __future__ import annotations

import gzip
import hashlib
import http.server
import json
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from deepinfer_gateway.process.cli import main as cli_main
from deepinfer_gateway.workload import trace_sources
from deepinfer_gateway.workload.trace_sources import SOURCES, TraceFetchError, TraceSource, fetch
from deepinfer_gateway.workload.traces import load_trace
from tests.shared_data import TRACES, needs_shared

LINES = b"".join(
    json.dumps({"timestamp": 1000 * i, "input_length": 600, "output_length": 4, "hash_ids": [0, i + 1]}).encode()
    + b"\n" for i in range(5))


class Mirror:
    """A loopback HTTP server answering GET <path> from a dict; counts requests per path."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.hits: dict[str, int] = {}
        mirror = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                mirror.hits[self.path] = mirror.hits.get(self.path, 0) + 1
                body = mirror.files.get(self.path)
                self.send_response(200 if body is not None else 404)
                self.send_header("Content-Length", str(len(body or b"")))
                self.end_headers()
                self.wfile.write(body or b"")

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def put(self, source: TraceSource, body: bytes) -> None:
        self.files[f"/{source.repo}/{source.commit}/{source.path}"] = body

    def hits_for(self, source: TraceSource) -> int:
        return self.hits.get(f"/{source.repo}/{source.commit}/{source.path}", 0)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def mirror() -> Iterator[Mirror]:
    m = Mirror()
    yield m
    m.close()


@pytest.fixture
def generated(monkeypatch: pytest.MonkeyPatch) -> TraceSource:
    """A registry entry for a generated file, pinned by its SHA-256."""
    source = TraceSource("mooncake:test", "example/traces", "0" * 40, "t/test_trace.jsonl", "test",
                         sha256=hashlib.sha256(LINES).hexdigest(), size=len(LINES))
    monkeypatch.setitem(SOURCES, source.name, source)
    return source


def cache_entries(root: Path) -> list[str]:
    directory = root / "traces"
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


def test_first_use_downloads_and_verifies_then_the_cache_serves_without_network(
        mirror: Mirror, generated: TraceSource, tmp_path: Path) -> None:
    mirror.put(generated, LINES)
    path = fetch(generated.name, mirror=mirror.url, cache_root=tmp_path)
    assert path.read_bytes() == LINES and mirror.hits_for(generated) == 1
    assert path.parent == tmp_path / "traces" and cache_entries(tmp_path) == [path.name]
    mirror.close()  # from here on any network attempt fails
    assert fetch(generated.name, mirror=mirror.url, cache_root=tmp_path) == path
    assert mirror.hits_for(generated) == 1


def test_wrong_checksum_is_refused_and_not_cached(mirror: Mirror, generated: TraceSource, tmp_path: Path) -> None:
    mirror.put(generated, LINES.replace(b'"output_length": 4', b'"output_length": 5'))  # same size
    with pytest.raises(TraceFetchError, match="does not match the pinned sha256.*discarded"):
        fetch(generated.name, mirror=mirror.url, cache_root=tmp_path)
    assert cache_entries(tmp_path) == []  # no entry and no partial file left behind
    mirror.put(generated, LINES)
    assert fetch(generated.name, mirror=mirror.url, cache_root=tmp_path).read_bytes() == LINES


def test_oversized_missing_and_unknown_are_clear_errors(mirror: Mirror, generated: TraceSource,
                                                         tmp_path: Path) -> None:
    mirror.put(generated, LINES + b"\n" * 10)
    with pytest.raises(TraceFetchError, match=f"more than {len(LINES)} bytes"):
        fetch(generated.name, mirror=mirror.url, cache_root=tmp_path)
    mirror.files.clear()
    with pytest.raises(TraceFetchError, match="cannot download .*404"):
        fetch(generated.name, mirror=mirror.url, cache_root=tmp_path)
    assert cache_entries(tmp_path) == []
    with pytest.raises(TraceFetchError, match="unknown trace 'mooncake:nope'; choose from .*mooncake:conversation"):
        fetch("mooncake:nope", cache_root=tmp_path)


def test_a_damaged_cache_entry_is_fetched_again(mirror: Mirror, generated: TraceSource, tmp_path: Path) -> None:
    mirror.put(generated, LINES)
    path = fetch(generated.name, mirror=mirror.url, cache_root=tmp_path)
    path.write_bytes(LINES[:-10])
    assert fetch(generated.name, mirror=mirror.url, cache_root=tmp_path).read_bytes() == LINES
    assert mirror.hits_for(generated) == 2


def test_git_blob_pin_matches_git_itself(mirror: Mirror, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    blob = subprocess.run(["git", "hash-object", "--stdin"], input=LINES, capture_output=True,
                          check=True).stdout.decode().strip()
    source = TraceSource("mooncake:blob", "example/traces", "0" * 40, "t/blob.jsonl", "test", git_blob=blob)
    monkeypatch.setitem(SOURCES, source.name, source)
    mirror.put(source, LINES[:-1] + b" ")
    with pytest.raises(TraceFetchError, match="git blob id"):
        fetch(source.name, mirror=mirror.url, cache_root=tmp_path)
    mirror.put(source, LINES)
    assert fetch(source.name, mirror=mirror.url, cache_root=tmp_path).read_bytes() == LINES


def test_registry_pins_commits_and_every_source_has_a_digest_and_license() -> None:
    assert {"mooncake:conversation", "mooncake:synthetic", "mooncake:toolagent", "mooncake:arxiv",
            "azure:code", "azure:conv"} <= set(SOURCES)
    for source in SOURCES.values():
        assert len(source.commit) == 40 and int(source.commit, 16) >= 0
        assert source.sha256 or source.git_blob
        assert source.license
        assert source.url().startswith("https://raw.githubusercontent.com/")


SHARED_COPIES = {  # registry name -> byte-identical copy (decompressed where gzipped)
    "mooncake:synthetic": "mooncake_synthetic_trace.jsonl.gz",
    "azure:code": "AzureLLMInferenceTrace_code.csv",
    "azure:conv": "AzureLLMInferenceTrace_conv.csv",
}


def _shared_bytes(name: str) -> bytes:
    data = (TRACES / name).read_bytes()
    return gzip.decompress(data) if name.endswith(".gz") else data


@needs_shared(TRACES)
def test_real_pins_accept_the_published_files(mirror: Mirror, monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    for name, copy in SHARED_COPIES.items():
        mirror.put(SOURCES[name], _shared_bytes(copy))
    monkeypatch.setenv("DGW_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(trace_sources.MIRROR_ENV, mirror.url)
    synthetic = load_trace("mooncake:synthetic")
    assert synthetic.name == "mooncake:synthetic" and len(synthetic.requests) == 3993 and synthetic.has_prefix_info
    code = load_trace("azure:code")
    assert len(code.requests) == 8819 and not code.has_prefix_info
    assert len(load_trace("azure:conv").requests) == 19366
    # The synthetic trace's git blob id as GitHub records it: checks the blob-id path on a real file.
    as_blob = TraceSource("mooncake:synthetic-blob", SOURCES["mooncake:synthetic"].repo,
                          SOURCES["mooncake:synthetic"].commit, SOURCES["mooncake:synthetic"].path, "test",
                          git_blob="e4838049c0dcfc358a5f24ab08251279475cba94")
    monkeypatch.setitem(SOURCES, as_blob.name, as_blob)
    assert fetch(as_blob.name).read_bytes() == _shared_bytes(SHARED_COPIES["mooncake:synthetic"])


@needs_shared(TRACES)
def test_bench_cli_replays_a_named_trace(gateway, mirror: Mirror, monkeypatch: pytest.MonkeyPatch,
                                         tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mirror.put(SOURCES["azure:code"], _shared_bytes("AzureLLMInferenceTrace_code.csv"))
    monkeypatch.setenv("DGW_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv(trace_sources.MIRROR_ENV, mirror.url)
    rc = cli_main(["bench", "--url", gateway.url, "--trace", "azure:code", "--max-requests", "4", "--concurrency",
                   "4", "--out", str(tmp_path / "out"), "--no-progress", "--no-plots"])
    assert rc == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["trace"] == "azure:code" and last["completed"] == 4
    assert last["trace_source"]["sha256"] == SOURCES["azure:code"].sha256
    assert "CC-BY-4.0" in last["trace_source"]["license"]
    assert mirror.hits_for(SOURCES["azure:code"]) == 1


def test_bench_cli_names_an_unknown_trace(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="bench: unknown trace 'mooncake:nope'"):
        cli_main(["bench", "--url", "http://127.0.0.1:9", "--trace", "mooncake:nope", "--out", str(tmp_path)])
