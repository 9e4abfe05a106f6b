"""Image inputs: resolve, limit and preprocess the images of one request with deepseek-recipe.

`ImageInputs.resolve(conversation)` collects the image sources conversion found
(`image_url` parts, Anthropic `image` blocks, Responses `input_image`), refuses what the
limits forbid, and has deepseek-recipe fetch (remote URLs, only when enabled) and
preprocess them (`ImageResolver(ReqwestImageFetcher, OpenCvImagePreprocessor)`). The
result carries the preprocessed bytes (base64, for the worker's vision encoder) and
`image_token_adjustment`: the prompt tokens the images add beyond one placeholder each,
which counts against the context limit and in routing.

SSRF: remote fetches go through `destination_allowed`, deepseek-recipe's
`with_destination_filter` hook, called for every address a host (or a redirect target)
resolves to. Only globally routable unicast addresses pass; loopback, private (RFC 1918,
ULA fc00::/7), link-local (169.254/16, fe80::/10), shared (100.64/10), multicast,
reserved, unspecified and the cloud metadata addresses (169.254.169.254,
fd00:ec2::254) are refused unless the host name or a CIDR in `allow` admits them.

Decoding: memory grows with pixels, not encoded bytes (an 8 KiB PNG may declare 8192 x 8192).
Each inline image's header is read first (the `imagesize` library: no decoding) and its declared
pixels, and the request's total, are checked against `max_image_pixels` and
`max_total_image_pixels` before anything is decoded; an image whose size its header does not
tell is refused.
A fetched image is decoded as fetched (its bytes are bounded by `max_image_bytes`).

Cost: preprocessing is CPU-bound (~ms per image) and fetching blocks, so callers run
`resolve` off the event loop (RequestPreparer.prepare_async does, `max_concurrent`
requests at a time: offload.py).
"""

from __future__ import annotations

import base64
import binascii
import io
import ipaddress
import struct
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import partial

import deepseek_recipe as dr
import imagesize

from deepinfer_gateway.config import ImageSettings

METADATA_ADDRESSES = frozenset({ipaddress.ip_address("169.254.169.254"), ipaddress.ip_address("fd00:ec2::254")})


class ImageRefused(Exception):
    """An image request the gateway refuses (HTTP 400), with a message for the client."""


@dataclass(frozen=True)
class AllowList:
    hosts: frozenset[str] = frozenset()
    networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()

    @classmethod
    def parse(cls, entries: Iterable[str]) -> AllowList:
        hosts: set[str] = set()
        networks = []
        for entry in entries:
            try:
                networks.append(ipaddress.ip_network(entry.strip(), strict=False))
            except ValueError:
                hosts.add(entry.strip().lower().rstrip("."))
        return cls(frozenset(hosts), tuple(networks))

    def admits(self, host: str, ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
        if host.lower().strip("[]").rstrip(".") in self.hosts:
            return True
        return any(ip.version == net.version and ip in net for net in self.networks)


def destination_allowed(host: str, address: str, allow: AllowList = AllowList()) -> bool:
    """May the fetcher connect to `address` (one resolution of `host`)?"""
    try:
        ip = ipaddress.ip_address(address.strip("[]").split("%", 1)[0])
    except ValueError:
        return False
    if allow.admits(host, ip):
        return True
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip in METADATA_ADDRESSES:
        return False
    return ip.is_global and not ip.is_multicast and not ip.is_reserved and not ip.is_unspecified


@dataclass(frozen=True)
class ResolvedImages:
    images: list[str] = field(default_factory=list)  # base64 of the preprocessed bytes, prompt order
    token_adjustment: int = 0


def _inline_bytes(source: dr.ImageSource) -> bytes | None:
    """An inline image's encoded bytes (None for a URL to fetch)."""
    if source.data is not None:
        return bytes(source.data)
    data_url = source.data_url
    if data_url is None:
        return None
    meta, _, payload = data_url.partition(",")
    if meta.endswith(";base64"):
        return base64.b64decode(payload)
    return urllib.parse.unquote_to_bytes(payload)


def _declared_pixels(source: dr.ImageSource, where: str) -> int:
    """Pixels an inline image's header declares (0 for a URL to fetch); refused when unreadable."""
    try:
        data = _inline_bytes(source)
    except (binascii.Error, ValueError):
        raise ImageRefused(f"{where}: invalid image: its data URL is not valid base64.") from None
    if data is None:
        return 0
    try:
        width, height = imagesize.get(io.BytesIO(data))
    except (ValueError, struct.error, IndexError, OSError):
        width = height = -1
    if width < 0 or height < 0:
        raise ImageRefused(f"{where}: unsupported image: its header does not give its size (not an image, "
                           "an unknown format, or cut short).")
    return int(width) * int(height)


def _estimated_bytes(source: dr.ImageSource) -> int:
    if source.data is not None:
        return len(source.data)
    data_url = source.data_url
    if data_url is not None:
        return len(data_url.partition(",")[2]) * 3 // 4
    return 0


class ImageInputs:
    def __init__(self, settings: ImageSettings):
        self.settings = settings
        fetcher = dr.ReqwestImageFetcher.with_max_bytes(settings.max_image_bytes)
        fetcher = fetcher.with_destination_filter(partial(destination_allowed, allow=AllowList.parse(settings.allow)))
        self._resolver = dr.ImageResolver(fetcher, dr.OpenCvImagePreprocessor())

    def sources(self, conversation: dr.Conversation) -> list[dr.ImageSource]:
        return [source for message in conversation.messages for source in message.image_sources]

    def resolve(self, sources: list[dr.ImageSource]) -> ResolvedImages:
        if not sources:
            return ResolvedImages()
        limits = self.settings
        if len(sources) > limits.max_images:
            raise ImageRefused(f"Too many images: {len(sources)} in this request, the limit is {limits.max_images}.")
        total = 0
        for source in sources:
            where = source.path or "an image"
            if source.url is not None and not limits.remote_fetch:
                raise ImageRefused(f"{where}: remote image URLs are disabled on this server; "
                                   "send the image inline as a base64 data URL.")
            size = _estimated_bytes(source)
            if size > limits.max_image_bytes:
                raise ImageRefused(f"{where}: image of about {size} bytes exceeds the limit of "
                                   f"{limits.max_image_bytes} bytes per image.")
            total += size
        if total > limits.max_total_image_bytes:
            raise ImageRefused(f"Images total about {total} bytes, over the limit of "
                               f"{limits.max_total_image_bytes} bytes per request.")
        pixels = 0
        for source in sources:
            where = source.path or "an image"
            declared = _declared_pixels(source, where)
            if declared > limits.max_image_pixels:
                raise ImageRefused(f"{where}: image of {declared} pixels exceeds the limit of "
                                   f"{limits.max_image_pixels} pixels per image.")
            pixels += declared
        if pixels > limits.max_total_image_pixels:
            raise ImageRefused(f"Images total {pixels} pixels, over the limit of {limits.max_total_image_pixels} "
                               "pixels per request.")
        quota = dr.ImageQuota()
        try:
            data = self._resolver.resolve(sources, quota)
            adjustment = data.image_token_adjustment()
        except dr.ImageError as exc:
            raise ImageRefused(f"Invalid image ({exc.kind}): {exc}") from None
        except (dr.CalcResizeError, ValueError) as exc:
            raise ImageRefused(f"Invalid image: {exc}") from None
        if quota.byte_size() > limits.max_total_image_bytes:
            raise ImageRefused(f"Images total {quota.byte_size()} bytes, over the limit of "
                               f"{limits.max_total_image_bytes} bytes per request.")
        return ResolvedImages([base64.b64encode(info.data).decode() for info in data.images], adjustment)
