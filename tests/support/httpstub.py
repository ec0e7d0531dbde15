"""An HTTP service that answers every GET with one fixed body: another service behind a
mistyped URL, or a page of metrics written for a test."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@contextlib.contextmanager
def answering(body: str | Callable[[str], tuple[int, str]],
              content_type: str = "application/json") -> Iterator[str]:
    """Yields the service's base URL (loopback, a port of the kernel's choosing).
    `body`: the answer to every GET, or a function of the path giving (status, body)."""
    class Answer(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status, text = body(self.path) if callable(body) else (200, body)
            data = text.encode()
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
