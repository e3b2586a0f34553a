"""The API-key rule and the bounded, timed body read shared by the HTTP servers (the reward server, the rollout
server); the connection rules below them are http_guard.py's.

A request carries the key as `Authorization: Bearer KEY` or `X-API-Key: KEY`; servers compare it in constant time
from the headers alone, before reading the body. A server bound to an address other machines can reach needs a
key unless its operator says otherwise (`--allow-no-key`).
"""
import asyncio
import hmac
import ipaddress
import time
from typing import Dict, Optional

LOOPBACK_NAMES = ("localhost",)


def key_matches(headers: Dict[bytes, bytes], api_key: str) -> bool:
    """The request carries `api_key` (Authorization: Bearer KEY or X-API-Key: KEY), compared in constant time."""
    given = headers.get(b"x-api-key", b"").decode("latin-1")
    auth = headers.get(b"authorization", b"").decode("latin-1")
    if auth.lower().startswith("bearer "):
        given = given or auth[7:].strip()
    return bool(given) and hmac.compare_digest(given.encode(), api_key.encode())


def is_loopback(host: str) -> bool:
    """`host` is reachable from this machine only (localhost, 127.0.0.0/8, ::1)."""
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind_problem(host: str, api_key: str, allow_no_key: bool, what: str, key_env: str):
    """Why serving `host` is refused (None: it is not): a non-loopback address without a key and without
    --allow-no-key. `what` says what an anonymous client could make the server do."""
    if is_loopback(host) or api_key or allow_no_key:
        return None
    return (f"--host {host} is reachable from other machines and no API key is set: anyone who can reach the port "
            f"could {what}. Set --api-key KEY (or ${key_env}), bind 127.0.0.1, or pass --allow-no-key to serve "
            f"{host} without a key")


class BodyTimeout(Exception):
    """A request's body did not arrive in time (its message says how much came and the rule)."""


async def read_body(receive, headers: Dict[bytes, bytes], limit: int, timeout: Optional[float] = None,
                    min_rate: float = 1.0):
    """(body, None) when the request's body fits in `limit` bytes; (None, size) as soon as it does not (its declared
    Content-Length, or the bytes read so far); (None, None) when the client disconnected first. With `timeout`, the
    body must be complete within `timeout` seconds of the first read plus one second per `min_rate` MiB received
    (a large body arriving at `min_rate` MiB/s or faster never runs out of time; one trickled byte by byte does):
    BodyTimeout otherwise."""
    declared = headers.get(b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        return None, int(declared)
    chunks, size = [], 0
    start = time.monotonic()
    while True:
        if timeout is None:
            message = await receive()
        else:
            left = start + timeout + size / (min_rate * 2 ** 20) - time.monotonic()
            try:
                message = await asyncio.wait_for(receive(), max(left, 0.0))
            except asyncio.TimeoutError:
                raise BodyTimeout(f"request body not complete after {time.monotonic() - start:.1f} s ({size} bytes "
                                  f"received; a body has {timeout:g} s plus 1 s per {min_rate:g} MiB received: "
                                  "body_timeout, min_body_rate)") from None
        if message["type"] == "http.disconnect":
            return None, None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None, size
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks), None


def replaying(body: bytes, receive):
    """A `receive` that hands the application `body` (already read) once, then the client's own messages."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replay
