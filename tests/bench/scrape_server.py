"""A scrape target in its own process, so client threads don't share its GIL.

`ours`: the agent's HTTP server over 8 simulated GPUs + 8 ranks.
`baseline`: prometheus_client's own threaded WSGI server with the same GPU numbers
held in Gauge objects (the common exporter design).
"""

from __future__ import annotations

import sys
import threading
from wsgiref.simple_server import WSGIRequestHandler
from wsgiref.simple_server import make_server as make_wsgi_server

from prometheus_client.exposition import ThreadingWSGIServer, make_wsgi_app


class _Quiet(WSGIRequestHandler):
    def log_message(self, *args) -> None:
        pass


def main(kind: str, port: int) -> None:
    from clusterpulse.agent.server import make_server
    from tests.bench.bench_agent import _agent, _gauge_baseline

    agent = _agent()
    agent.collect_once()
    if kind == "ours":
        server = make_server(agent, "127.0.0.1", port, None)
    else:
        reg, update = _gauge_baseline(agent)
        update()
        server = make_wsgi_server("127.0.0.1", port, make_wsgi_app(reg), ThreadingWSGIServer,
                                  handler_class=_Quiet)
    print("ready", flush=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    sys.stdin.read()  # until the parent closes our stdin


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
