"""A light HTTP/1.1 load client: asyncio streams writing a request prebuilt as bytes, one connection per
request, opened before the burst starts. It exists so that a burst measures the server rather than
the client: on 2 cores httpx with 200 connections used as much CPU as the API it was timing (1.3 CPU-s
against 0.7 for 200 POSTs), where the floor's client (temporalio's, one gRPC connection) uses little.

No TLS, no redirects, no chunked bodies: enough for JSON answers of our own API on loopback.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any
from urllib.parse import urlsplit


def build_request(base_url: str, method: str, path: str, body: dict | None, headers: dict[str, str]) -> bytes:
    host = urlsplit(base_url).netloc
    payload = json.dumps(body).encode() if body is not None else b""
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", "Connection: close",
             *(f"{k}: {v}" for k, v in headers.items())]
    if body is not None:
        lines += ["Content-Type: application/json", f"Content-Length: {len(payload)}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + payload


class Connection:
    """One TCP connection, opened ahead of time; `send` writes one request and reads its response."""

    def __init__(self, base_url: str) -> None:
        parts = urlsplit(base_url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    async def send(self, request: bytes) -> tuple[int, Any]:
        assert self.reader is not None and self.writer is not None
        self.writer.write(request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        status = int(status_line.split(" ", 2)[1])
        length = None
        for line in header_lines:
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-length":
                length = int(value.strip())
        raw = await (self.reader.readexactly(length) if length is not None else self.reader.read())
        try:
            body: Any = json.loads(raw) if raw else None
        except ValueError:
            body = raw[:200].decode(errors="replace")
        return status, body

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except OSError:
                pass
