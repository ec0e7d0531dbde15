"""A webhook receiver on loopback that records what Alertmanager sends it."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class WebhookSink:
    def __init__(self) -> None:
        self.received: list[dict] = []
        self.auth: list[tuple[str, str | None]] = []  # (path, Authorization header)
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                sink.auth.append((self.path, self.headers.get("Authorization")))
                try:
                    sink.received.append(json.loads(body))
                finally:
                    self.send_response(200)
                    self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def alerts(self) -> list[dict]:
        return [a for payload in self.received for a in payload.get("alerts", [])]

    def stop(self) -> None:
        self.server.shutdown()
