"""Fetching the images a request names, under the server's media policy (as vLLM).

- `data:image/...;base64,...` URLs are decoded in place (a non-image media type is refused);
- `http(s)://` URLs are fetched with a timeout, a size cap (streamed: a huge body is cut off
  at the cap, never read whole) and a content-type check (`image/*`); hosts that resolve to a
  private, loopback, link-local or reserved address are refused unless named in
  `--allowed-media-domains`; with that list set, only its hosts (and their subdomains) are
  fetched at all; redirects are followed by hand (at most 3), each hop checked again;
- `file://` URLs are read only under `--allowed-local-media-path`.
Every refusal is a `MediaError` (HTTP 400) saying why. NOTE: the address check resolves the
host before httpx connects; a DNS answer that changes in between (rebinding) is not caught.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import ipaddress
import os
import socket
import urllib.parse
from dataclasses import dataclass

from k2serve.multimodal.image import ImageError

MAX_IMAGE_BYTES = 20 * 1024 * 1024
FETCH_TIMEOUT_S = 10.0
_MAX_REDIRECTS = 3


class MediaError(ImageError):
    """An image reference that cannot be used (bad URL, refused, unreachable, too big)."""


@dataclass(frozen=True)
class MediaPolicy:
    allowed_local_media_path: str | None = None
    allowed_media_domains: tuple[str, ...] = ()
    max_bytes: int = MAX_IMAGE_BYTES
    timeout_s: float = FETCH_TIMEOUT_S

    def domain_listed(self, host: str) -> bool:
        host = host.lower().rstrip(".")
        return any(host == d or host.endswith("." + d) for d in self.allowed_media_domains)


def decode_data_url(url: str, max_bytes: int = MAX_IMAGE_BYTES) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep:
        raise MediaError("malformed data URL: no ',' before the data")
    media = head[len("data:") :]
    mime = media.split(";")[0].strip().lower()
    if mime and not mime.startswith("image/"):
        raise MediaError(f"the data URL holds {mime!r}, not an image")
    if len(payload) > max_bytes * 4 // 3 + 4:
        raise MediaError(f"the image is larger than {max_bytes} bytes")
    if ";base64" in media.lower():
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise MediaError("the data URL's base64 data is invalid") from None
    return urllib.parse.unquote_to_bytes(payload)


def read_local(url: str, policy: MediaPolicy) -> bytes:
    root = policy.allowed_local_media_path
    if not root:
        raise MediaError(
            "file:// URLs are refused (start the server with --allowed-local-media-path)"
        )
    path = urllib.parse.unquote(urllib.parse.urlparse(url).path)
    real, base = os.path.realpath(path), os.path.realpath(root)
    if os.path.commonpath([real, base]) != base:
        raise MediaError(f"{path!r} is outside --allowed-local-media-path")
    try:
        size = os.path.getsize(real)
        if size > policy.max_bytes:
            raise MediaError(f"the image is larger than {policy.max_bytes} bytes")
        with open(real, "rb") as f:
            return f.read()
    except OSError as e:
        raise MediaError(f"cannot read {path!r}: {e.strerror}") from None


def _is_public(addr: str) -> bool:
    ip = ipaddress.ip_address(addr.split("%")[0])
    return not (
        ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_reserved
        or ip.is_multicast or ip.is_unspecified
    )  # fmt: skip


async def _check_host(url: str, policy: MediaPolicy) -> None:
    parts = urllib.parse.urlparse(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise MediaError(f"unsupported image URL {url[:80]!r} (use data:, http(s):// or file://)")
    host = parts.hostname
    listed = policy.domain_listed(host)
    if policy.allowed_media_domains and not listed:
        raise MediaError(f"the host {host!r} is not in --allowed-media-domains")
    if listed:
        return
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, parts.port or 443)
    except (socket.gaierror, UnicodeError):
        raise MediaError(f"cannot resolve the image host {host!r}") from None
    for info in infos:
        if not _is_public(str(info[4][0])):
            raise MediaError(
                f"the image host {host!r} is a private or loopback address; it is refused unless "
                "listed in --allowed-media-domains"
            )


async def _get(client, url: str, policy: MediaPolicy) -> bytes:
    for _ in range(_MAX_REDIRECTS + 1):
        await _check_host(url, policy)
        async with client.stream("GET", url) as r:
            if r.is_redirect and "location" in r.headers:
                url = urllib.parse.urljoin(url, r.headers["location"])
                continue
            if r.status_code != 200:
                raise MediaError(f"fetching the image gave HTTP {r.status_code}")
            ctype = r.headers.get("content-type", "").split(";")[0].strip().lower()
            if not ctype.startswith("image/"):
                raise MediaError(
                    f"the image URL returned {ctype or 'no content type'!r}, not image/*"
                )
            declared = r.headers.get("content-length")
            if declared and declared.isdigit() and int(declared) > policy.max_bytes:
                raise MediaError(f"the image is larger than {policy.max_bytes} bytes")
            body = bytearray()
            async for chunk in r.aiter_bytes():
                body += chunk
                if len(body) > policy.max_bytes:
                    raise MediaError(f"the image is larger than {policy.max_bytes} bytes")
            return bytes(body)
    raise MediaError(f"more than {_MAX_REDIRECTS} redirects fetching the image")


async def fetch_http(url: str, policy: MediaPolicy) -> bytes:
    """GET an http(s) image; the whole fetch (redirects, a slow body) gets `timeout_s`."""
    import httpx

    try:
        async with httpx.AsyncClient(timeout=policy.timeout_s, follow_redirects=False) as client:
            return await asyncio.wait_for(_get(client, url, policy), policy.timeout_s)
    except (asyncio.TimeoutError, httpx.TimeoutException):
        raise MediaError(f"fetching the image took more than {policy.timeout_s:g}s") from None
    except httpx.HTTPError as e:
        raise MediaError(f"cannot fetch the image: {type(e).__name__}: {e}") from None


async def fetch_image_bytes(url: str, policy: MediaPolicy) -> bytes:
    """The encoded bytes an image URL names, under `policy`; MediaError otherwise."""
    if not isinstance(url, str) or not url:
        raise MediaError("the image URL is empty")
    scheme = url.split(":", 1)[0].lower()
    if scheme == "data":
        return decode_data_url(url, policy.max_bytes)
    if scheme == "file":
        return await asyncio.to_thread(read_local, url, policy)
    return await fetch_http(url, policy)


def fetch_image_bytes_sync(url: str, policy: MediaPolicy) -> bytes:
    """`fetch_image_bytes` for the offline API (no event loop running)."""
    return asyncio.run(fetch_image_bytes(url, policy))


def part_image_ref(part: dict):
    """An OpenAI / vLLM content part -> its image (a URL string or a PIL image), or None for a
    part that holds no image. Video parts are a MediaError."""
    t = part.get("type")
    if t in ("video_url", "video", "input_video"):
        raise MediaError(
            "video input is not supported (the K2.5 model card calls video experimental and "
            "served only by Moonshot's API)"
        )
    if t == "image_url":
        ref = part.get("image_url")
        return ref.get("url") if isinstance(ref, dict) else ref
    if t == "input_image":  # Responses API
        ref = part.get("image_url")
        return ref.get("url") if isinstance(ref, dict) else ref
    if t == "image_pil":
        return part.get("image_pil")
    if t == "image":
        return part.get("image")
    return None


def chat_images(messages: list[dict], policy: MediaPolicy | None = None) -> tuple[list, list]:
    """Offline `LLM.chat`: (PIL images in order, messages whose image parts are plain
    {"type": "image"} markers for the chat template)."""
    from k2serve.multimodal.image import load_image

    policy = policy or MediaPolicy()
    images: list = []
    out: list[dict] = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            out.append(m)
            continue
        parts = []
        for part in content:
            ref = part_image_ref(part) if isinstance(part, dict) else None
            if ref is None:
                parts.append(part)
                continue
            if isinstance(ref, str):
                ref = load_image(fetch_image_bytes_sync(ref, policy))
            images.append(ref)
            parts.append({"type": "image"})
        out.append({**m, "content": parts})
    return images, out
