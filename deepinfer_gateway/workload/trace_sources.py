"""Published request traces by name (`mooncake:conversation`, `azure:code` ...), fetched once.

`fetch(name)` returns the path of a verified local copy. The first call downloads the
file from its pinned commit into `<cache root>/traces/` (the cache root of
`recipe_bridge.derived_cache`: $DGW_CACHE_DIR, else $XDG_CACHE_HOME/deepinfer-gateway,
else ~/.cache/deepinfer-gateway); later calls use that copy without the network.

Integrity: every source pins a digest of the published file, and a file is accepted
only if its digest matches, on download and again on every use (hashing a few MB costs
milliseconds, and a cache entry damaged on disk is then fetched anew instead of
replayed). Most sources pin the file's SHA-256; the two large Mooncake files pin their
git blob id, `sha1("blob <size>\\0" + content)`, which is the digest the publishing
repository itself records for them (the only one that could be checked here, see
docs/bench.md). A download goes to a temporary file in the cache directory and is
renamed into place only after verification, so an interrupted or corrupt download never
leaves a cache entry; a mismatch raises `TraceFetchError` and deletes the download.

Mirrors: $DGW_TRACE_MIRROR (or `mirror=`) replaces `https://raw.githubusercontent.com`
in every URL, for hosts without GitHub access: a mirror serves the same tree
(`<mirror>/<owner>/<repo>/<commit>/<path>`), and the pinned digests still decide.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from deepinfer_gateway.recipe_bridge.derived_cache import cache_dir

log = logging.getLogger(__name__)

GITHUB_RAW = "https://raw.githubusercontent.com"
MIRROR_ENV = "DGW_TRACE_MIRROR"
MAX_UNPINNED_BYTES = 1 << 30  # size cap when a source pins no size: stops a runaway download
_CHUNK = 1 << 20


class TraceFetchError(RuntimeError):
    """A named trace that could not be fetched or failed verification; the message says which and why."""


@dataclass(frozen=True)
class TraceSource:
    """One published trace file at a pinned commit of a public GitHub repository."""

    name: str
    repo: str  # owner/name
    commit: str  # 40 hex digits: a commit, never a branch, so the content cannot move
    path: str
    license: str
    sha256: str | None = None
    git_blob: str | None = None  # used when no SHA-256 is pinned
    size: int | None = None

    def url(self, mirror: str | None = None) -> str:
        return f"{(mirror or GITHUB_RAW).rstrip('/')}/{self.repo}/{self.commit}/{self.path}"

    @property
    def file_name(self) -> str:
        digest = self.sha256 or self.git_blob
        return f"{self.name.replace(':', '-')}-{(digest or '')[:16]}-{Path(self.path).name}"


_MOONCAKE = "kvcache-ai/Mooncake"
_MOONCAKE_COMMIT = "3b5a594133958449a1feaf1c9e0fc1b553e34a28"
_MOONCAKE_LICENSE = "Apache-2.0 (repository license, LICENSE-APACHE)"
_AZURE = "Azure/AzurePublicDataset"
_AZURE_COMMIT = "b469a113cedca53ddc3bdea71a143dc4b7d8700c"
_AZURE_LICENSE = "CC-BY-4.0 (repository LICENSE; cite Patel et al., Splitwise, ISCA 2024)"

SOURCES: dict[str, TraceSource] = {s.name: s for s in (
    TraceSource("mooncake:conversation", _MOONCAKE, _MOONCAKE_COMMIT, "FAST25-release/traces/conversation_trace.jsonl",
                _MOONCAKE_LICENSE, sha256="b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df",
                size=3029533),
    TraceSource("mooncake:synthetic", _MOONCAKE, _MOONCAKE_COMMIT, "FAST25-release/traces/synthetic_trace.jsonl",
                _MOONCAKE_LICENSE, sha256="bd070915a98fc0ed264d7cfef2ce746002eb3076a695ec31ba2674c0111ec131",
                size=1136313),
    TraceSource("mooncake:toolagent", _MOONCAKE, _MOONCAKE_COMMIT, "FAST25-release/traces/toolagent_trace.jsonl",
                _MOONCAKE_LICENSE, git_blob="b765599d1e0828b37f68d481563c385d3c11de54"),
    TraceSource("mooncake:arxiv", _MOONCAKE, _MOONCAKE_COMMIT, "FAST25-release/arxiv-trace/mooncake_trace.jsonl",
                _MOONCAKE_LICENSE, git_blob="d68d1c6ce27b35a168edc235d36d0202d233f0f2"),
    TraceSource("azure:code", _AZURE, _AZURE_COMMIT, "data/AzureLLMInferenceTrace_code.csv", _AZURE_LICENSE,
                sha256="54e9a6d2a4bd06ba1e060304b900abbc74cbea53de96506e60fe5bb4f2277fb6", size=320117),
    TraceSource("azure:conv", _AZURE, _AZURE_COMMIT, "data/AzureLLMInferenceTrace_conv.csv", _AZURE_LICENSE,
                sha256="2f1e5b666d4e3055fdbba98598ce2ec307767b9064e03e2fa46676dbcc7d0bf8", size=719188),
)}


class _Digest:
    """The pinned digest of a source, computed incrementally over the file's bytes."""

    def __init__(self, source: TraceSource, size: int) -> None:
        if source.sha256:
            self.kind, self.expected, self._h = "sha256", source.sha256, hashlib.sha256()
        elif source.git_blob:
            # The blob header needs the size up front: the caller passes the file's size.
            self.kind, self.expected, self._h = "git blob id", source.git_blob, hashlib.sha1()
            self._h.update(f"blob {size}\0".encode())
        else:
            raise TraceFetchError(f"{source.name}: no digest pinned")

    def update(self, data: bytes) -> None:
        self._h.update(data)

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def _file_digest(source: TraceSource, path: Path) -> str:
    digest = _Digest(source, path.stat().st_size)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _download(source: TraceSource, url: str, target: Path, timeout_s: float) -> None:
    """Stream `url` into a temporary file beside `target`, verify it, then rename it into place."""
    limit = source.size or MAX_UNPINNED_BYTES
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=timeout_s) as response:
            written = 0
            while chunk := response.read(_CHUNK):
                written += len(chunk)
                if written > limit:
                    raise TraceFetchError(f"{source.name}: {url} sent more than {limit} bytes; refused")
                out.write(chunk)
        actual = _file_digest(source, tmp)
        expected = source.sha256 or source.git_blob
        if actual != expected:
            raise TraceFetchError(
                f"{source.name}: {url} does not match the pinned {_Digest(source, 0).kind} "
                f"(expected {expected}, got {actual}); the download was discarded")
        os.replace(tmp, target)
    except (urllib.error.URLError, OSError) as exc:
        raise TraceFetchError(f"{source.name}: cannot download {url}: {exc}") from None
    finally:
        tmp.unlink(missing_ok=True)


def fetch(name: str, *, mirror: str | None = None, cache_root: Path | None = None,
          timeout_s: float = 60.0) -> Path:
    """The verified local copy of the named trace, downloaded on first use."""
    source = SOURCES.get(name)
    if source is None:
        raise TraceFetchError(f"unknown trace {name!r}; choose from {', '.join(sorted(SOURCES))}")
    directory = (cache_root or cache_dir()) / "traces"
    target = directory / source.file_name
    if target.exists():
        if _file_digest(source, target) == (source.sha256 or source.git_blob):
            return target
        log.warning("cached %s at %s fails verification; downloading it again", name, target)
        target.unlink(missing_ok=True)
    url = source.url(mirror or os.environ.get(MIRROR_ENV))
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise TraceFetchError(f"{name}: cannot create the cache directory {directory}: {exc}") from None
    log.info("downloading %s from %s into %s", name, url, target)
    _download(source, url, target, timeout_s)
    return target
