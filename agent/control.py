"""The agent's control API under /v1/: authenticated, JSON in and out.

Off unless a token is configured (no token -> every /v1/ call answers 403 saying so);
bearer tokens are compared in constant time and each names its principal (see
agent.tokens), which is what the audit log records as `who`. A caller's own
`requested_by` is kept as `on_behalf_of` (the dashboard passes its signed-in
operator), never as the principal. Failed authentication is audited too (at most
`AUTH_FAILURES_PER_MIN` records a minute, so a flood cannot fill the disk; the rest
are counted). Handlers return (status, body) and never raise on bad input: the body's
"error" names the problem.

A restart of a run that already has one in flight on this node is refused with 409:
"error" names the command in flight and "in_flight" is that command. A stuck graceful
one is forced to a hard restart by naming it: POST /v1/commands/<id>/escalate.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import TYPE_CHECKING, Any

from clusterpulse.agent import protocol
from clusterpulse.agent.backends.sim import SimBackend
from clusterpulse.agent.commands import InFlight
from clusterpulse.agent.faults import FAULT_KINDS, FaultError, parse_fault
from clusterpulse.agent.httpsafe import HttpError, parse_json_object
from clusterpulse.agent.tokens import Tokens, credentials
from clusterpulse.agent.validate import bounded_number

if TYPE_CHECKING:
    from clusterpulse.agent.core import Agent

Response = tuple[int, dict[str, Any]]
AUTH_FAILURES_PER_MIN = 30
MAX_DEADLINE_S = 3600


def check_bearer(header: str | None, tokens: Tokens | None) -> tuple[str | None, Response | None]:
    """(principal, None) if authorised, else (None, the error response)."""
    if not tokens:
        return None, (403, {"error": "control API disabled: start the agent with --token-file"})
    presented = credentials(header, "Bearer")
    if not presented:
        return None, (401, {"error": "missing bearer token (Authorization: Bearer <token>)"})
    principal = tokens.match(presented)
    if principal is None:
        return None, (401, {"error": "wrong token"})
    return principal, None


class ControlApi:
    def __init__(self, agent: Agent, token: str | Tokens | None) -> None:
        self.agent = agent
        self.tokens = Tokens.single(token) if isinstance(token, str) else token
        self.auth_failures = collections.Counter[str]()
        self._audited: collections.deque[float] = collections.deque()
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return bool(self.tokens)

    def authenticate(self, header: str | None, client: str = "?"
                     ) -> tuple[str | None, Response | None]:
        principal, denied = check_bearer(header, self.tokens)
        if denied is not None and denied[0] == 401:
            self._audit_failure(denied[1]["error"], client)
        return principal, denied

    def _audit_failure(self, reason: str, client: str) -> None:
        now = time.monotonic()
        with self._lock:
            self.auth_failures[reason] += 1
            while self._audited and now - self._audited[0] > 60:
                self._audited.popleft()
            if len(self._audited) >= AUTH_FAILURES_PER_MIN:
                return
            self._audited.append(now)
        self.agent.audit.write("unauthenticated", "authenticate", reason, "refused",
                               client=client, node=self.agent.node, source="agent")

    def handle(self, method: str, path: str, auth: str | None, body: bytes,
               principal: str | None = None, client: str = "?") -> Response:
        """One /v1/ request. `principal` set: the caller already authenticated it."""
        if principal is None:
            principal, denied = self.authenticate(auth, client)
            if denied is not None:
                return denied
        assert principal is not None
        parts = [p for p in path.split("/") if p][1:]  # drop "v1"
        payload: Any = {}
        if method == "POST":
            try:
                payload = parse_json_object(body)
            except HttpError as err:
                return err.status, {"error": err.reason}
        match method, parts:
            case "GET", ["ranks"]:
                return 200, {"ranks": self._ranks()}
            case "GET", ["faults"]:
                return self._faults()
            case "POST", ["faults"]:
                return self._inject(payload, principal)
            case "POST", ["runs", run, "actions"]:
                return self._action(run, payload, principal)
            case "POST", ["commands", cid, "escalate"]:
                return self._escalate(cid, payload, principal)
            case "GET", ["commands"]:
                return 200, {"commands": [c.to_json() for c in self.agent.commands.all()]}
            case "GET", ["commands", cid]:
                cmd = self.agent.commands.get(cid)
                if cmd is None:
                    return 404, {"error": f"no command {cid[:160]!r}"}
                return 200, cmd.to_json()
        return 404, {"error": f"no route {method} {path[:200]}"}

    def _ranks(self) -> list[dict]:
        reg = self.agent.ranks
        return [
            {"run": r.run, "rank": r.rank, "local_rank": r.local_rank, "pid": r.pid,
             "uid": r.sender.uid if r.sender.verified else None,  # the kernel's word
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

    def _inject(self, payload: dict, principal: str) -> Response:
        sim = self._sim()
        if sim is None:
            return 409, {"error": "fault injection needs the simulated backend (--backend sim)"}
        try:
            fault = parse_fault({k: v for k, v in payload.items() if k != "requested_by"},
                                sim.gpu_count)
        except FaultError as err:
            return 400, {"error": str(err)}
        sim.inject(fault)
        self.agent.audit.write(principal, f"fault:{fault.kind}", "injected through control API",
                               "applied", node=self.agent.node, gpu=fault.gpu, source="agent",
                               **_on_behalf(payload))
        return 200, {"injected": {"kind": fault.kind, "gpu": fault.gpu}}

    def _action(self, run: str, payload: dict, principal: str) -> Response:
        if not protocol.RUN_ID.fullmatch(run):
            return 400, {"error": "run id must be 1-128 of A-Z a-z 0-9 _ . : -"}
        action = payload.get("action")
        if not isinstance(action, str) or action not in protocol.ACTIONS:
            return 400, {"error": f"'action' must be one of {sorted(protocol.ACTIONS)}"}
        reason = payload.get("reason")
        if not isinstance(reason, str) or not reason.strip():
            return 400, {"error": "'reason' is required: say why, it goes to the audit log"}
        deadline = bounded_number(payload.get("deadline_s", 120), 1, MAX_DEADLINE_S)
        if deadline is None:
            return 400, {"error": f"'deadline_s' must be a number of seconds in "
                                  f"1..{MAX_DEADLINE_S}"}
        leave = bounded_number(payload.get("leave_s", 0), 0, protocol.MAX_LEAVE_S)
        if leave is None or (leave and action != "checkpoint-restart"):
            return 400, {"error": f"'leave_s' (seconds this node sits the restart out) must "
                                  f"be a number in 0..{protocol.MAX_LEAVE_S}, and only with "
                                  "checkpoint-restart"}
        try:
            cmd = self.agent.commands.submit(run, action, reason.strip()[:500], principal,
                                             deadline, leave_s=leave, **_on_behalf(payload))
        except InFlight as busy:  # one restart at a time: the caller learns which
            return 409, {"error": str(busy), "in_flight": busy.command.to_json()}
        return (202 if cmd.state != "failed" else 409), cmd.to_json()

    def _escalate(self, cid: str, payload: dict, principal: str) -> Response:
        """Force a stuck graceful command to a hard restart now (its deadline would)."""
        reason = payload.get("reason")
        if not isinstance(reason, str) or not reason.strip():
            return 400, {"error": "'reason' is required: say why, it goes to the audit log"}
        try:
            cmd = self.agent.commands.escalate(cid, principal, reason.strip()[:500],
                                               **_on_behalf(payload))
        except LookupError as err:
            return 404, {"error": str(err.args[0])}
        except ValueError as err:
            return 409, {"error": str(err)}
        return 202, cmd.to_json()


def _on_behalf(payload: dict) -> dict[str, str]:
    """The caller's own account of whom it acts for: recorded, never trusted as `who`."""
    who = payload.get("requested_by")
    return {"on_behalf_of": who[:128]} if isinstance(who, str) and who.strip() else {}
