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
import io
import json
import logging
import resource
import select
import socket
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from clusterpulse.agent.peeruid import client_key
from clusterpulse.agent.validate import host_port, is_digits

log = logging.getLogger(__name__)

READ_TIMEOUT_S = 10.0  # a request's whole head, then its body: absolute deadlines
MAX_CONNECTIONS = 64  # threads serving requests (whole heads only)
SCRAPE_SLOTS = 4  # more threads, for GET of the scrape paths only
MAX_PENDING = 4096  # connections whose head has not arrived yet, in all
MAX_PENDING_PER_CLIENT = 1024  # ... from one address (its oldest is closed for a new one)
MAX_HEAD = 16384  # bytes looked at for the end of a request head
# TLS handshakes one client may start a second in the gate: each costs a private-key
# operation in its one thread (RSA-4096: ~4 ms), and a user replaying one recorded
# ClientHello, at no cost of their own, held every HTTPS request 8-10 s (a review).
HANDSHAKES_PER_CLIENT_S = 20


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
    if not is_digits(raw):
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


class _Prefixed(io.RawIOBase):
    """A connection's bytes with the ones the gate already read put back in front (over
    TLS the head cannot be peeked: the gate decrypts and keeps it)."""

    def __init__(self, prefix: bytes, raw: Any) -> None:
        self._prefix = memoryview(prefix)
        self._raw = raw

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        if self._prefix:
            n = min(len(b), len(self._prefix))
            b[:n] = self._prefix[:n]
            self._prefix = self._prefix[n:]
            return n
        return self._raw.readinto(b)


class SafeHandler(BaseHTTPRequestHandler):
    """Base handler: read timeout, JSON replies, quiet logs."""

    timeout = READ_TIMEOUT_S  # socket timeout for every read: idle clients go away
    protocol_version = "HTTP/1.0"

    def setup(self) -> None:
        super().setup()
        prefix = self.server.read_ahead.pop(id(self.connection), b"")  # type: ignore[attr-defined]
        if prefix:
            self.rfile = io.BufferedReader(_Prefixed(prefix,
                                                     self.connection.makefile("rb", buffering=0)))

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
    """Threads bounded by `max_connections`; TLS when given a context.

    A connection gets a thread only once its request head has arrived whole: until
    then it waits in the gate (`_Gate`, one epoll thread for all of them), costing a
    file descriptor and nothing else, for at most `READ_TIMEOUT_S` from its accept.
    64 slow connections with no token used to hold every thread and keep /metrics and
    the webhook at 503; now 1,000 of them (tests/bench) leave both answering. Each
    client may keep `MAX_PENDING_PER_CLIENT` connections waiting (its oldest is closed
    for a new one), `MAX_PENDING` in all; GET of a `scrape_paths` path has
    `SCRAPE_SLOTS` threads of its own, so busy workers never refuse Prometheus; one
    client holds at most half of the other threads; and every request is cut off
    `READ_TIMEOUT_S` after it got its thread (its reads end: an absolute deadline, not
    a timeout per read that a trickle of bytes renews).
    """

    daemon_threads = True
    # The stdlib default backlog of 5 makes concurrent scrapers wait for SYN retries
    # (a 1 s stall each): measured p99 2.7 s with 50 scrapers before this, see docs.
    request_queue_size = 1024
    scrape_paths: frozenset[str] = frozenset({"/metrics", "/metrics/progress", "/healthz", "/"})

    def __init__(self, addr: tuple[str, int], handler: type[BaseHTTPRequestHandler],
                 max_connections: int = MAX_CONNECTIONS,
                 tls: ssl.SSLContext | None = None) -> None:
        self.max_connections = max_connections
        self._slots = threading.BoundedSemaphore(max_connections)
        self._scrape_slots = threading.BoundedSemaphore(SCRAPE_SLOTS)
        self._per_client: dict[str, int] = {}  # client key -> worker threads held
        self._scraping: set[str] = set()  # clients holding a scrape slot (one each)
        self._count_lock = threading.Lock()
        self.tls = tls
        self.read_ahead: dict[int, bytes] = {}  # id(TLS connection) -> its head, read
        self.refused_busy = 0
        self.refused_handshakes = 0  # TLS connections closed over their client's rate
        raise_fd_limit()
        # A bind that fails (the port is held) calls server_close from inside
        # super().__init__, before the gate exists.
        self._gate: _Gate | None = None
        if ":" in addr[0]:  # an IPv6 host (`--listen [::]:9477`): the class says IPv4
            self.address_family = socket.AF_INET6
        super().__init__(addr, handler)
        self._gate = _Gate(self)

    def process_request(self, request: Any, client_address: Any) -> None:
        """From the accept loop: the connection waits in the gate for its head."""
        self._gate.admit(request, client_address)

    def dispatch(self, request: socket.socket, client_address: Any, scrape: bool,
                 client: str, read: bytes = b"") -> None:
        """From the gate: a thread for a connection whose head has arrived, or 503.
        One client (peeruid.client_key: a loopback user, else an address) holds half the
        workers at most, scrapes included; a scrape beyond that, or with every worker
        busy, takes a slot kept for scrapes, one per client."""
        slots: threading.BoundedSemaphore | None = None
        with self._count_lock:
            held = self._per_client.get(client, 0)
            if held < max(1, self.max_connections // 2) and self._slots.acquire(blocking=False):
                self._per_client[client] = held + 1
                slots = self._slots
            elif scrape and client not in self._scraping \
                    and self._scrape_slots.acquire(blocking=False):
                self._scraping.add(client)
                slots = self._scrape_slots
        if slots is None:
            self.refused_busy += 1
            self._busy(request)
            return
        if read:
            self.read_ahead[id(request)] = read
        try:
            threading.Thread(target=self._serve_one, daemon=True,
                             args=(request, client_address, slots, client)).start()
        except Exception:
            self._release(slots, client)
            self.shutdown_request(request)
            raise

    def _release(self, slots: threading.BoundedSemaphore, client: str) -> None:
        with self._count_lock:
            if slots is self._slots:
                held = self._per_client.get(client, 1) - 1
                if held > 0:
                    self._per_client[client] = held
                else:
                    self._per_client.pop(client, None)
            else:
                self._scraping.discard(client)
        slots.release()

    def _serve_one(self, request: socket.socket, client_address: Any,
                   slots: threading.BoundedSemaphore, client: str) -> None:
        self._gate.watch(request, time.monotonic() + READ_TIMEOUT_S)
        try:
            self.process_request_thread(request, client_address)
        finally:
            self._gate.unwatch(request)
            self._release(slots, client)

    def finish_request(self, request: Any, client_address: Any) -> None:
        request.settimeout(READ_TIMEOUT_S)  # blocking again, after the gate
        try:
            super().finish_request(request, client_address)
        finally:
            self.read_ahead.pop(id(request), None)

    def _busy(self, request: socket.socket) -> None:
        self.refuse(request, 503, "too many connections; retry later")

    def refuse(self, request: socket.socket, status: int, reason: str) -> None:
        """Answer with `status` and a JSON reason, without a worker, and close."""
        body = json.dumps({"error": reason}).encode()
        phrase = {431: "Request Header Fields Too Large", 503: "Service Unavailable"}[status]
        try:  # over TLS too: the gate has finished the handshake
            request.settimeout(1.0)
            request.sendall(f"HTTP/1.0 {status} {phrase}\r\nContent-Type: "
                            "application/json\r\nRetry-After: 1\r\nContent-Length: "
                            f"{len(body)}\r\n\r\n".encode() + body)
        except OSError:  # ssl.SSLError included
            pass
        finally:
            self.shutdown_request(request)

    def server_close(self) -> None:
        super().server_close()
        if self._gate is not None:
            self._gate.close()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """One bad connection is logged, never printed as a traceback on stderr."""
        log.warning("error serving %s", client_address[0], exc_info=True)


def listen_address(text: str, what: str = "--listen") -> tuple[str, int]:
    """HOST:PORT as every server's --listen takes it (an empty host is loopback).
    Raises ValueError naming `what` and the form expected."""
    address = host_port(text)
    if address is None:
        raise ValueError(f"{what} must be HOST:PORT (e.g. 127.0.0.1:9477), got {text!r}")
    return address


def raise_fd_limit(want: int = 65536) -> int:
    """Raise this process's soft limit on open files towards `want` (within the hard
    limit): each waiting connection is a descriptor, and systemd's default soft limit
    (1,024) would make accept() fail with EMFILE long before the gate's caps apply.
    Returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as err:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, target, err)
    return soft


class _Gate:
    """Connections whose request head has not arrived yet, watched by one thread.

    Edge-triggered epoll and MSG_PEEK: the head is looked at, never consumed, so the
    handler reads the request as it would have; a connection is handed over once its
    head is whole (a blank line). Over TLS the gate runs the handshake without blocking
    and reads the decrypted head itself (handed to the handler in front of the rest):
    a connection used to get its thread at its first encrypted byte, so scrapes could
    not be told apart and two clients' stalled handshakes held every worker. Also the
    reaper of the absolute deadlines of connections being served."""

    def __init__(self, server: SafeServer) -> None:
        self.server = server
        self._ep = select.epoll()
        self._lock = threading.Lock()
        # fd -> (socket, client address, client key, deadline); insertion order = age
        self._waiting: dict[int, tuple[socket.socket, Any, str, float]] = {}
        self._by_client: dict[str, list[int]] = {}
        self._serving: dict[int, tuple[socket.socket, float]] = {}
        self._read: dict[int, bytearray] = {}  # TLS: fd -> the head decrypted so far
        self._shaking: set[int] = set()  # TLS: fds whose handshake has begun
        self._handshakes: dict[str, tuple[float, int]] = {}  # client -> (second, count)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="http-gate", daemon=True)
        self._thread.start()

    def admit(self, sock: socket.socket, addr: Any) -> None:
        client = client_key(sock, addr)
        if client == "closed":  # a peer on this host that is gone (a hello and close:
            # it would have been handshaken under a key of no one's, a review's way
            # round the per-client handshake rate)
            self.server.shutdown_request(sock)
            return
        evicted: list[socket.socket] = []
        with self._lock:
            mine = self._by_client.setdefault(client, [])
            while len(mine) >= MAX_PENDING_PER_CLIENT:
                evicted.append(self._forget(mine[0]))
            while len(self._waiting) >= MAX_PENDING:
                evicted.append(self._forget(next(iter(self._waiting))))
            fd = sock.fileno()
            if self.server.tls is not None:
                sock.setblocking(False)
                sock = self.server.tls.wrap_socket(sock, server_side=True,
                                                   do_handshake_on_connect=False)
                self._read[fd] = bytearray()
            self._waiting[fd] = (sock, addr, client, time.monotonic() + READ_TIMEOUT_S)
            self._by_client.setdefault(client, []).append(fd)
            self._ep.register(fd, select.EPOLLIN | select.EPOLLRDHUP | select.EPOLLET)
        for old in evicted:
            self.server.shutdown_request(old)

    def _forget(self, fd: int) -> socket.socket:
        """Take a waiting connection out (the lock held); the caller closes or serves it."""
        sock, _, client, _ = self._waiting.pop(fd)
        self._read.pop(fd, None)
        self._shaking.discard(fd)
        mine = self._by_client.get(client, [])
        if fd in mine:
            mine.remove(fd)
        if not mine:
            self._by_client.pop(client, None)
        with contextlib.suppress(OSError, ValueError):
            self._ep.unregister(fd)
        return sock

    def watch(self, sock: socket.socket, deadline: float) -> None:
        with self._lock:
            self._serving[id(sock)] = (sock, deadline)

    def unwatch(self, sock: socket.socket) -> None:
        with self._lock:
            self._serving.pop(id(sock), None)


    def close(self) -> None:
        with self._lock:
            self._closed = True
            waiting = [self._forget(fd) for fd in list(self._waiting)]
        for sock in waiting:
            self.server.shutdown_request(sock)
        with contextlib.suppress(OSError):
            self._ep.close()

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
            try:
                events = self._ep.poll(0.25)
            except (OSError, ValueError):  # closed under us
                return
            for fd, _ in events:
                try:
                    self._look(fd)
                except Exception:  # never let the gate die (a socket closed under it)
                    log.exception("http gate: a connection failed")
            self._expire()

    def _look(self, fd: int) -> None:
        with self._lock:
            entry = self._waiting.get(fd)
        if entry is None:
            return
        sock, addr, client, _ = entry
        read = b""
        if isinstance(sock, ssl.SSLSocket):
            got = self._tls_read(fd, sock) if self._may_shake(fd, client) else b""
            if got is None:
                return  # the handshake or the head goes on: the next edge brings more
            head = read = got
        else:
            try:
                head = sock.recv(MAX_HEAD, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                head = b""
        whole = b"\r\n\r\n" in head or b"\n\n" in head
        if head and not whole and len(head) < MAX_HEAD:
            return  # more to come: the next edge brings it
        with self._lock:
            if self._waiting.get(fd) is not entry:
                return
            self._forget(fd)
        if not head:  # the client went away
            self.server.shutdown_request(sock)
            return
        if not whole:  # a head this long is refused here: in a worker, the stdlib
            # parser would wait for its end until the deadline, holding the thread
            self.server.refuse(sock, 431, "request head larger than "
                               f"{MAX_HEAD} bytes")
            return
        line = head.split(b"\r\n", 1)[0].split(b" ")
        path = line[1].split(b"?", 1)[0].decode("latin-1") if len(line) > 1 else ""
        scrape = line[0] == b"GET" and path in self.server.scrape_paths
        try:
            self.server.dispatch(sock, addr, scrape, client, read)
        except Exception:  # never let the gate die: log and go on
            log.exception("cannot serve %s", addr[0] if addr else "?")

    def _may_shake(self, fd: int, client: str) -> bool:
        """Whether the connection may (go on with its) handshake: a client starts at
        most HANDSHAKES_PER_CLIENT_S a second; the others are closed unread."""
        if fd in self._shaking:
            return True
        now = int(time.monotonic())
        second, count = self._handshakes.get(client, (now, 0))
        count = count + 1 if second == now else 1
        if len(self._handshakes) > 4 * MAX_PENDING:  # forget old seconds, bounded
            self._handshakes = {c: v for c, v in self._handshakes.items() if v[0] == now}
        self._handshakes[client] = (now, count)
        if count > HANDSHAKES_PER_CLIENT_S:
            self.server.refused_handshakes += 1
            return False
        self._shaking.add(fd)
        return True

    def _tls_read(self, fd: int, sock: ssl.SSLSocket) -> bytes | None:
        """The TLS connection's head so far once it is whole, too long, or the client
        has gone (b""); None while the handshake or the head is under way."""
        buf = self._read.get(fd)
        if buf is None:
            return b""
        try:
            sock.do_handshake()  # a no-op once done
            while len(buf) < MAX_HEAD and b"\r\n\r\n" not in buf and b"\n\n" not in buf:
                chunk = sock.recv(MAX_HEAD - len(buf))
                if not chunk:
                    return b""
                buf += chunk
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError, BlockingIOError):
            return None
        except (ssl.SSLError, OSError) as err:
            log.debug("TLS connection failed before its request: %s", err)
            return b""
        return bytes(buf)

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            late = [self._forget(fd) for fd, (*_, t) in list(self._waiting.items())
                    if t <= now]
            cut = [sock for sock, t in self._serving.values() if t <= now]
            for sock in cut:
                self._serving.pop(id(sock), None)
        for sock in late:
            self.server.shutdown_request(sock)
        for sock in cut:  # its reads end now; a reply being written still goes out
            with contextlib.suppress(OSError):
                # the plain socket's shutdown, on a TLS wrapper too (SSLSocket's own
                # drops its SSL object under the thread reading through it)
                socket.socket.shutdown(sock, socket.SHUT_RD)


def tls_context(cert: Path, key: Path) -> ssl.SSLContext:
    """A server context from PEM files; ValueError with the reason when they don't load."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(str(cert), str(key))
    except (OSError, ssl.SSLError) as err:
        raise ValueError(f"cannot load TLS certificate {cert} / key {key}: {err}") from None
    return ctx
