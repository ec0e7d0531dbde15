"""HTTP front door of the agent: /metrics (and /metrics/progress), /healthz and the /v1/
control API.

Built on agent.httpsafe: Content-Length checked and bodies capped before anything is
read, the bearer token checked before the body is read, read timeouts, a connection
limit, optional TLS, and a JSON reason for every refusal.
"""

from __future__ import annotations

import ssl
import threading
import time
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from clusterpulse.agent.control import ControlApi, Tokens
from clusterpulse.agent.exporter import AgentCollector, ProgressCollector
from clusterpulse.agent.httpsafe import (
    MAX_CONNECTIONS,
    HttpError,
    SafeHandler,
    SafeServer,
    content_length,
    read_body,
)

if TYPE_CHECKING:
    from clusterpulse.agent.core import Agent

MAX_BODY = 64 * 1024
_UNAUTHORIZED = {"WWW-Authenticate": 'Bearer realm="clusterpulse"'}


def make_server(agent: Agent, host: str, port: int, token: str | Tokens | None,
                tls: ssl.SSLContext | None = None,
                max_connections: int = MAX_CONNECTIONS) -> SafeServer:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AgentCollector(agent))
    progress = CollectorRegistry(auto_describe=False)
    progress.register(ProgressCollector(agent))
    control = ControlApi(agent, token)
    cache: dict[str, tuple[int, bytes]] = {}  # content type -> (cycle, body)
    cache_lock = threading.Lock()

    def render(accept: str) -> tuple[bytes, str]:
        """Render once per collection cycle and share it between concurrent scrapers.

        Everything exported changes at most once a cycle except rank telemetry, which
        is then at most one interval old: cheap scrapes matter more when 50 arrive.
        """
        encoder, ctype = choose_encoder(accept)
        # Also re-render once a second without a new cycle: when a collection is stuck
        # (a hung NVML call) the collection age and the ranks' heartbeat ages must keep
        # growing in what Prometheus scrapes, not freeze at the last cycle's body.
        cycle = (agent.snapshot.cycles, int(time.monotonic()))
        with cache_lock:
            hit = cache.get(ctype)
            if hit is None or hit[0] != cycle:
                hit = cache[ctype] = (cycle, encoder(registry))
        return hit[1], ctype

    class Handler(SafeHandler):
        server_version = "clusterpulse-agent"

        def _reply(self, status: int, payload: dict) -> None:
            self.send_json(status, payload, _UNAUTHORIZED if status == 401 else None)

        def _client(self) -> str:
            return self.client_address[0] if self.client_address else "?"

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self.send_bytes(200, *render(self.headers.get("Accept", "")))
            elif path == "/metrics/progress":
                # hang detection's evidence alone, scraped every second: rendered at
                # each request (a few series per rank), so ages are never a cycle old
                encoder, ctype = choose_encoder(self.headers.get("Accept", ""))
                self.send_bytes(200, encoder(progress), ctype)
            elif path in ("/healthz", "/"):
                snap = agent.snapshot
                stopped = agent.stopped_threads()
                self.send_json(200 if not stopped else 503, {
                                     "status": f"stopped: {', '.join(stopped)}" if stopped
                                     else "ok",
                                     "node": agent.node,
                                     "backend": agent.backend.name, "gpus": len(snap.gpus),
                                     "gpus_up": sum(g.up for g in snap.gpus),
                                     "last_collection_unix": snap.timestamp,
                                     "control_api": control.enabled})
            elif path.startswith("/v1/"):
                self._reply(*control.handle("GET", path, self.headers.get("Authorization"),
                                            b"", client=self._client()))
            else:
                self.send_json(404, {"error": f"no route {path}"})

        def do_POST(self) -> None:
            path = self.path.split("?", 1)[0]
            try:
                length = content_length(self.headers, MAX_BODY)
                if not path.startswith("/v1/"):
                    raise HttpError(404, f"no route {path}")
                principal, denied = control.authenticate(self.headers.get("Authorization"),
                                                         client=self._client())
                if denied is not None:  # before reading a byte of the body
                    self.close_connection = True
                    self._reply(*denied)
                    return
                body = read_body(self, length)
            except HttpError as err:
                self.refuse(err)
                return
            except TimeoutError:
                self.refuse(HttpError(408, "timed out reading the request body"))
                return
            self._reply(*control.handle("POST", path, None, body, principal=principal))

    return SafeServer((host, port), Handler, max_connections=max_connections, tls=tls)


def serve_in_thread(server: SafeServer) -> threading.Thread:
    t = threading.Thread(target=server.serve_forever, name="agent-http", daemon=True)
    t.start()
    return t
