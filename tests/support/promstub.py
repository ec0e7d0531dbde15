"""A Prometheus query API that answers one question, for unit tests of the policy's
re-check: which ALERTS are firing (real Prometheus with real rules is in
tests/integration). Every query is recorded."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse


class AlertsPrometheus:
    """`firing(query)` says whether the ALERTS query has a firing series; `found(query)`,
    whether any other query has one (by default none has; None: answered 503, as a
    Prometheus that is restarting)."""

    def __init__(self, firing: Callable[[str], bool],
                 found: Callable[[str], bool | None] = lambda query: False) -> None:
        self.queries: list[str] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                query = parse_qs(urlparse(self.path).query).get("query", [""])[0]
                stub.queries.append(query)
                alerts = query.startswith("ALERTS{")
                hit = firing(query) if alerts else found(query)
                if hit is None:
                    self.send_error(503)
                    return
                result = ([{"metric": {"__name__": "ALERTS" if alerts else "series"},
                            "value": [time.time(), "1"]}] if hit else [])
                body = json.dumps({"status": "success", "data": {
                    "resultType": "vector", "result": result}}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
