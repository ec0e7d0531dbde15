"""The agent's control API under /v1/: authenticated, JSON in and out.

Off unless a token is configured (no token -> every /v1/ call answers 403 saying so);
the bearer token is compared in constant time. Handlers return (status, body) and
never raise on bad input: the body's "error" names the problem.
"""

from __future__ import annotations

import hmac
import json
from typing import TYPE_CHECKING, Any

from agent import protocol
from agent.backends.sim import SimBackend
from agent.faults import FAULT_KINDS, FaultError, parse_fault

if TYPE_CHECKING:
    from agent.core import Agent

Response = tuple[int, dict[str, Any]]


def check_bearer(header: str | None, token: str | None) -> Response | None:
    """None if authorised, else the error response. Shared by every /v1/ route."""
    if not token:
        return 403, {"error": "control API disabled: start the agent with --token-file"}
    if not header or not header.startswith("Bearer "):
        return 401, {"error": "missing bearer token (Authorization: Bearer <token>)"}
    if not hmac.compare_digest(header[len("Bearer "):].strip().encode(), token.encode()):
        return 401, {"error": "wrong token"}
    return None


class ControlApi:
    def __init__(self, agent: Agent, token: str | None) -> None:
        self.agent = agent
        self.token = token

    def handle(self, method: str, path: str, auth: str | None, body: bytes) -> Response:
        denied = check_bearer(auth, self.token)
        if denied is not None:
            return denied
        parts = [p for p in path.split("/") if p][1:]  # drop "v1"
        payload: Any = {}
        if method == "POST":
            try:
                payload = json.loads(body or b"{}")
            except ValueError:
                return 400, {"error": "request body is not valid JSON"}
            if not isinstance(payload, dict):
                return 400, {"error": "request body must be a JSON object"}
        match method, parts:
            case "GET", ["ranks"]:
                return 200, {"ranks": self._ranks()}
            case "GET", ["faults"]:
                return self._faults()
            case "POST", ["faults"]:
                return self._inject(payload)
            case "POST", ["runs", run, "actions"]:
                return self._action(run, payload)
            case "GET", ["commands"]:
                return 200, {"commands": [c.to_json() for c in self.agent.commands.all()]}
            case "GET", ["commands", cid]:
                cmd = self.agent.commands.get(cid)
                if cmd is None:
                    return 404, {"error": f"no command {cid!r}"}
                return 200, cmd.to_json()
        return 404, {"error": f"no route {method} {path}"}

    def _ranks(self) -> list[dict]:
        reg = self.agent.ranks
        return [
            {"run": r.run, "rank": r.rank, "local_rank": r.local_rank, "pid": r.pid,
             "gpu": r.gpu, "step": r.step, "restarts": r.restarts,
             "heartbeat_age_seconds": round(reg.age(r), 3)}
            for r in reg.snapshot()
        ]

    def _sim(self) -> SimBackend | None:
        b = self.agent.backend
        return b if isinstance(b, SimBackend) else None

    def _faults(self) -> Response:
        sim = self._sim()
        if sim is None:
            return 409, {"error": "fault injection needs the simulated backend (--backend sim)"}
        return 200, {
            "kinds": FAULT_KINDS,
            "injected": [{"at_s": round(t, 3), "kind": f.kind, "gpu": f.gpu}
                         for t, f in sim.injected],
        }

    def _inject(self, payload: dict) -> Response:
        sim = self._sim()
        if sim is None:
            return 409, {"error": "fault injection needs the simulated backend (--backend sim)"}
        try:
            fault = parse_fault({k: v for k, v in payload.items() if k != "requested_by"},
                                sim.gpu_count)
        except FaultError as err:
            return 400, {"error": str(err)}
        sim.inject(fault)
        who = str(payload.get("requested_by", "api"))[:128]
        self.agent.audit.write(who, f"fault:{fault.kind}", "injected through control API",
                               "applied", node=self.agent.node, gpu=fault.gpu, source="agent")
        return 200, {"injected": {"kind": fault.kind, "gpu": fault.gpu}}

    def _action(self, run: str, payload: dict) -> Response:
        action = payload.get("action")
        if action not in protocol.ACTIONS:
            return 400, {"error": f"'action' must be one of {sorted(protocol.ACTIONS)}"}
        reason = payload.get("reason")
        if not isinstance(reason, str) or not reason.strip():
            return 400, {"error": "'reason' is required: say why, it goes to the audit log"}
        deadline = payload.get("deadline_s", 120)
        if not isinstance(deadline, int | float) or not 1 <= deadline <= 3600:
            return 400, {"error": "'deadline_s' must be a number of seconds in 1..3600"}
        who = payload.get("requested_by", "api")
        cmd = self.agent.commands.submit(run, action, reason.strip()[:500], str(who)[:128],
                                         float(deadline))
        return (202 if cmd.state != "failed" else 409), cmd.to_json()
