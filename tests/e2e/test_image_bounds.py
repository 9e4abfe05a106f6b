"""Images are bounded by the pixels their headers declare, before anything decodes them: a tiny
PNG declaring 8192 x 8192 pixels is refused (400, OpenAI's error shape) without the gateway's
memory growing, and so is a request whose images together exceed the per-request total.
Real gateway process and sim worker, real openai SDK."""

from __future__ import annotations

import base64
import io
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from openai.types.chat import ChatCompletionContentPartParam
from PIL import Image

from harness.launch import Gateway
from tests.gateways import one_worker_gateway

pytestmark = pytest.mark.e2e

MODEL = "DeepSeek-V4.1-Flash"
PER_IMAGE = 100 * 100
PER_REQUEST = 150 * 100


def _huge_png(side: int = 8192) -> bytes:
    """A valid grayscale PNG of side x side black pixels, a few tens of KiB (made row by row)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    packer = zlib.compressobj(9)
    row = b"\x00" * (side + 1)  # filter byte + pixels
    idat = b"".join(packer.compress(row) for _ in range(side)) + packer.flush()
    header = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def _png(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (0, 128, 255)).save(buf, "PNG")
    return buf.getvalue()


def _url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _peak_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    toml = f"[images]\nmax_image_pixels = {PER_IMAGE}\nmax_total_image_pixels = {PER_REQUEST}\n"
    with one_worker_gateway(tmp_path_factory.mktemp("images"), toml) as gw:
        yield gw


@pytest.fixture
def client(gateway: Gateway) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key="test", max_retries=0, timeout=60) as c:
        yield c


def _ask(client: openai.OpenAI, *urls: str) -> object:
    parts: list[ChatCompletionContentPartParam] = [{"type": "text", "text": "Describe."}]
    parts += [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return client.chat.completions.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": parts}])


def test_an_image_within_the_bounds_is_served(client: openai.OpenAI) -> None:
    assert _ask(client, _url(_png(100, 100)))


def test_a_small_png_declaring_8192_squared_pixels_is_refused_before_decoding(gateway: Gateway,
                                                                              client: openai.OpenAI) -> None:
    png = _huge_png()
    assert len(png) < 512 * 1024
    before = _peak_rss_kib(gateway.proc.proc.pid)
    with pytest.raises(openai.BadRequestError) as refused:
        _ask(client, _url(png))
    assert f"image of {8192 * 8192} pixels exceeds the limit of {PER_IMAGE} pixels" in refused.value.message
    assert _peak_rss_kib(gateway.proc.proc.pid) - before < 64 * 1024  # nothing decoded: no 64+ MB of pixels


def test_images_over_the_per_request_pixel_total_are_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        _ask(client, _url(_png(100, 100)), _url(_png(100, 100)))
    assert f"Images total {2 * PER_IMAGE} pixels, over the limit of {PER_REQUEST}" in refused.value.message


def test_an_image_whose_size_cannot_be_read_is_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        _ask(client, "data:image/png;base64," + base64.b64encode(b"not an image at all").decode())
    assert "unsupported image: its header does not give its size" in refused.value.message
