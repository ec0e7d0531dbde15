"""Hardened HTTP serving shared by the agent and the remediation receiver.

The stdlib server trusts its clients: it reads whatever Content-Length says (a
negative one reads to EOF, bypassing any cap), waits forever on idle connections and
starts a thread per connection without limit. Here every request is bounded before a
byte of its body is read, idle clients time out, connections beyond a limit get a 503
at once, optional TLS is negotiated in the connection's own thread (a slow handshake
never stalls the accept loop), and every refusal is a 4xx/5xx with a JSON reason.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

READ_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 64


class HttpError(Exception):
    """A request refused before it reached the application; status and reason."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


def content_length(headers: Any, max_bytes: int) -> int:
    """The declared body length, validated: never negative, never above the cap."""
    if headers.get("Transfer-Encoding"):
        raise HttpError(411, "chunked bodies are not accepted: send Content-Length")
    raw = headers.get("Content-Length")
    if raw is None or raw.strip() == "":
        return 0
    raw = raw.strip()
    # ASCII digits only: also refuses "-1", "+5", "1e3" and str.isdigit()'s other
    # digits ("¹", "٣"), which int() cannot parse
    if not (raw.isascii() and raw.isdigit()):
        raise HttpError(400, f"Content-Length must be a non-negative integer, got {raw[:32]!r}")
    if len(raw) > 12 or int(raw) > max_bytes:
        raise HttpError(413, f"body larger than {max_bytes} bytes")
    return int(raw)


def read_body(handler: BaseHTTPRequestHandler, length: int) -> bytes:
    body = handler.rfile.read(length) if length else b""
    if len(body) != length:
        raise HttpError(400, f"body shorter than its Content-Length ({len(body)} < {length})")
    return body


def parse_json_object(body: bytes, empty_ok: bool = True) -> dict[str, Any]:
    """A JSON object, or HttpError(400) naming what is wrong; never another exception."""
    if not body.strip():
        if empty_ok:
            return {}
        raise HttpError(400, "request body is empty: a JSON object is required")
    try:
        payload = json.loads(body, parse_constant=_no_constant)
    except RecursionError:
        raise HttpError(400, "request body is nested too deeply") from None
    except HttpError:
        raise
    except (ValueError, UnicodeDecodeError):
        raise HttpError(400, "request body is not valid JSON") from None
    if not isinstance(payload, dict):
        raise HttpError(400, "request body must be a JSON object")
    return payload


def _no_constant(text: str) -> Any:
    raise HttpError(400, f"request body holds {text}, which is not a number")


class SafeHandler(BaseHTTPRequestHandler):
    """Base handler: read timeout, JSON replies, quiet logs."""

    timeout = READ_TIMEOUT_S  # socket timeout for every read: idle clients go away
    protocol_version = "HTTP/1.0"

    def log_message(self, fmt: str, *args: Any) -> None:  # quiet by default
        log.debug("%s " + fmt, self.address_string(), *args)

    def send_error(self, code: int, message: str | None = None,
                   explain: str | None = None) -> None:
        """The stdlib's malformed-request answers (bad request line, headers), as JSON."""
        self.close_connection = True
        self.request_version = "HTTP/1.0"  # a garbled line would otherwise get no status line
        with contextlib.suppress(OSError):
            self.send_json(code, {"error": message or explain or "bad request"})

    def send_bytes(self, status: int, body: bytes, ctype: str,
                   headers: dict[str, str] | None = None) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError, TimeoutError, ssl.SSLError):
            log.debug("client went away before the response was sent")

    def send_json(self, status: int, payload: dict, headers: dict[str, str] | None = None
                  ) -> None:
        self.send_bytes(status, json.dumps(payload).encode(), "application/json", headers)

    def refuse(self, err: HttpError) -> None:
        self.close_connection = True  # an unread body must not be parsed as a request
        self.send_json(err.status, {"error": err.reason})


class SafeServer(ThreadingHTTPServer):
    """Threads bounded by `max_connections`; TLS when given a context."""

    daemon_threads = True
    # The stdlib default backlog of 5 makes concurrent scrapers wait for SYN retries
    # (a 1 s stall each): measured p99 2.7 s with 50 scrapers before this, see docs.
    request_queue_size = 128

    def __init__(self, addr: tuple[str, int], handler: type[BaseHTTPRequestHandler],
                 max_connections: int = MAX_CONNECTIONS,
                 tls: ssl.SSLContext | None = None) -> None:
        self._slots = threading.BoundedSemaphore(max_connections)
        self.tls = tls
        self.refused_busy = 0
        super().__init__(addr, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused_busy += 1
            self._busy(request)
            return
        try:
            super().process_request(request, client_address)
        except Exception:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def finish_request(self, request: Any, client_address: Any) -> None:
        request.settimeout(READ_TIMEOUT_S)
        if self.tls is not None:
            try:
                request = self.tls.wrap_socket(request, server_side=True)
            except (OSError, ssl.SSLError) as err:
                log.debug("TLS handshake with %s failed: %s", client_address[0], err)
                return
        super().finish_request(request, client_address)

    def _busy(self, request: socket.socket) -> None:
        body = b'{"error": "too many connections; retry later"}'
        try:
            if self.tls is None:  # over TLS a plain answer would be noise: just close
                request.settimeout(1.0)
                request.sendall(b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: "
                                b"application/json\r\nRetry-After: 1\r\nContent-Length: "
                                + str(len(body)).encode() + b"\r\n\r\n" + body)
        except OSError:
            pass
        finally:
            self.shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """One bad connection is logged, never printed as a traceback on stderr."""
        log.warning("error serving %s", client_address[0], exc_info=True)


def tls_context(cert: Path, key: Path) -> ssl.SSLContext:
    """A server context from PEM files; ValueError with the reason when they don't load."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(str(cert), str(key))
    except (OSError, ssl.SSLError) as err:
        raise ValueError(f"cannot load TLS certificate {cert} / key {key}: {err}") from None
    return ctx
