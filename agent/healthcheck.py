"""`clusterpulse-healthcheck`: is this node fit to run jobs? One answer, in the form
schedulers already consume.

It reads the local agent's /metrics (so it sees exactly what Prometheus sees) and
fails the node for what an operator would take it out of service for: a GPU that
stopped answering (fell off the bus), a critical XID not yet dealt with (healthstate:
since a reboot, an operator's resume or --acknowledge), uncorrectable ECC errors or a
failed row remap, an agent that answers but no longer collects (GPU reads that hang).

The output follows two protocols at once, because they agree:
- LBNL NHC / Slurm `HealthCheckProgram`: exit status 0 = healthy, non-zero = not, and
  one line naming the reason. slurmd ignores the exit status; like NHC, `--drain`
  drains the node itself (`scontrol update NodeName=... State=DRAIN Reason=...`) and
  resumes it once healthy again, but only if it was this check that drained it.
- Kubernetes Node Problem Detector custom plugins: exit 0 = OK, 1 = problem (the
  condition is set), 2 = unknown; stdout is the condition's message.

Unknown (2) means the check could not decide: the agent did not answer (refused, timed
out, not running yet), or answered something that is not its metrics. That is a
monitoring hiccup, not a fault of the node: an agent rollout restarts every agent at
once, and under Slurm with the agent run as a job step idle nodes have none. Taking
nodes out for it (NPD + draino cordon on 1, NHC-style --drain drains) would empty the
GPU pool for a monitoring problem, so only evidence about the GPUs or the node is a
problem (1), and on unknown Slurm is left untouched (no drain, no resume). A missing
agent is caught by Prometheus instead (NodeAgentDown).
"""

from __future__ import annotations

import argparse
import http.client
import math
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from clusterpulse.agent.healthstate import Counts, XidJudged, boot_id, hold_lock

OK, PROBLEM, UNKNOWN = 0, 1, 2
# Prefix of every reason we set in Slurm: a node drained by someone else (an admin,
# another check) is never resumed by us.
REASON_PREFIX = "clusterpulse:"
# XIDs after which NVIDIA's XID catalogue says the GPU needs a reset or a node drain
# (not the application errors such as 13/31/43 a buggy job can cause on a good GPU).
# 48 DBE ECC, 63/64 row remap event/failure, 74 NVLink, 79 fallen off the bus,
# 92 high single-bit ECC rate, 94/95 contained/uncontained ECC, 119/120 GSP errors,
# 140 unrecovered ECC.
CRITICAL_XIDS = frozenset({48, 63, 64, 74, 79, 92, 94, 95, 119, 120, 140})


@dataclass
class Verdict:
    status: int
    reasons: list[str] = field(default_factory=list)
    # the critical XIDs' counts per GPU UUID and code, whether new or not (healthstate)
    xids: Counts = field(default_factory=dict)

    @property
    def message(self) -> str:
        if self.status == OK:
            return "OK"
        return "; ".join(self.reasons)


def fetch_metrics(url: str, timeout: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode("utf-8", errors="replace")


def evaluate(text: str, now: float, max_age_s: float, xids: frozenset[int],
             ecc_max: float, judged: XidJudged | None = None) -> Verdict:
    """The verdict for one /metrics page; pure, so it is tested without an agent.
    With `judged`, only the XIDs counted since an operator dealt with the last ones
    (healthstate) are a problem; without, any."""
    try:
        families = {f.name: f for f in text_string_to_metric_families(text)}
    except ValueError as err:
        return Verdict(UNKNOWN, [f"agent metrics unreadable: {err}"])
    if "clusterpulse_gpu_up" not in families:
        return Verdict(UNKNOWN, ["agent metrics have no clusterpulse_gpu_up (not a "
                                 "ClusterPulse agent?)"])
    problems: list[str] = []
    counts: Counts = {}

    def samples(name: str, suffix: str = ""):
        fam = families.get(name)
        return [s for s in fam.samples if s.name == name + suffix] if fam else []

    last = samples("clusterpulse_agent_last_collection_timestamp_seconds")
    if last and now - last[0].value > max_age_s:
        problems.append(f"agent stale: last GPU collection {now - last[0].value:.0f} s ago")
    reasons = {(s.labels.get("gpu"), s.labels.get("reason")) for s in
               samples("clusterpulse_gpu_down_reason") if s.value}
    for s in samples("clusterpulse_gpu_up"):
        if s.value == 0:
            why = ",".join(sorted(r for g, r in reasons if g == s.labels.get("gpu") and r))
            problems.append(f"GPU {s.labels.get('gpu')} down" + (f" ({why})" if why else ""))
    for s in samples("clusterpulse_gpu_xid_errors", "_total"):
        code = int(s.labels.get("xid", "0") or 0)
        if code not in xids:
            continue
        uuid, total = s.labels.get("uuid", ""), int(s.value)
        counts.setdefault(uuid, {})[str(code)] = total
        new = judged.new(uuid, str(code), total) if judged is not None else total
        if new > 0:
            problems.append(f"GPU {s.labels.get('gpu')} XID {code} x{new}")
    for s in samples("clusterpulse_gpu_ecc_errors", "_total"):
        if s.labels.get("kind") == "uncorrected" and s.value > ecc_max:
            problems.append(f"GPU {s.labels.get('gpu')} {s.value:.0f} uncorrectable ECC errors")
    for s in samples("clusterpulse_gpu_row_remap_failed"):
        if s.value:
            problems.append(f"GPU {s.labels.get('gpu')} row remap failed")
    return Verdict(PROBLEM if problems else OK, problems, counts)


def read_page(url: str, timeout: float) -> str | Verdict:
    """The agent's metrics page, or the unknown verdict that says why there is none."""
    try:
        return fetch_metrics(url, timeout)
    except urllib.error.HTTPError as err:
        return Verdict(UNKNOWN, [f"agent at {url} answered HTTP {err.code}"])
    except (urllib.error.URLError, OSError) as err:  # refused, timed out, reset
        why = getattr(err, "reason", err) or type(err).__name__
        return Verdict(UNKNOWN, [f"agent unreachable at {url}: {why}"])
    except http.client.HTTPException as err:  # not HTTP, or the connection cut mid-answer
        return Verdict(UNKNOWN, [f"agent at {url} gave a bad answer: "
                                 f"{type(err).__name__} {err}".rstrip()])


def check(url: str, timeout: float, max_age_s: float, xids: frozenset[int],
          ecc_max: float, judged: XidJudged | None = None) -> Verdict:
    page = read_page(url, timeout)
    if isinstance(page, Verdict):
        return page
    return evaluate(page, time.time(), max_age_s, xids, ecc_max, judged)


class SlurmError(Exception):
    pass


def _scontrol(*args: str) -> str:
    exe = shutil.which("scontrol")
    if exe is None:
        raise SlurmError("scontrol not found in PATH; --drain needs Slurm's client tools")
    r = subprocess.run([exe, *args], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise SlurmError(f"scontrol {' '.join(args)} failed: {r.stderr.strip() or r.stdout}")
    return r.stdout


def node_state(node: str) -> tuple[str, str]:
    """(State, Reason) of a Slurm node, from `scontrol show node -o`."""
    fields: dict[str, str] = {}
    line = _scontrol("show", "node", "-o", node).strip()
    # Reason= is last but one and may contain spaces: split at known keys only.
    head, _, reason = line.partition(" Reason=")
    for tok in head.split():
        k, _, v = tok.partition("=")
        fields[k] = v
    reason = reason.split(" [", 1)[0].strip() if reason else ""
    return fields.get("State", ""), reason


def apply_to_slurm(node: str, verdict: Verdict, judged: XidJudged | None = None,
                   rejudge: Callable[[], Verdict] | None = None) -> str:
    """Drain on a problem; resume a node that this check drained once it is healthy.
    Unknown touches nothing: not even `scontrol show`, whose failure would count.

    With `judged`: a node this check drained that is no longer drained was resumed by
    an operator, so the XIDs it was drained for are done, and `rejudge` gives the
    verdict without them; a drain records the XIDs it was for."""
    if verdict.status == UNKNOWN:
        return ""
    state, reason = node_state(node)
    if judged is not None and judged.drained_for is not None and "DRAIN" not in state:
        judged.resumed()
        if rejudge is not None:
            verdict = rejudge()
    if verdict.status == PROBLEM:
        want = f"{REASON_PREFIX} {verdict.message}"[:200]
        if "DRAIN" in state and reason.startswith(REASON_PREFIX):
            if judged is None or (judged.drained_for or {}) == verdict.xids:
                return f"already drained: {reason}"
            # XIDs since the drain: the reason names them, so that an operator's resume
            # is for what they saw (it acknowledges `drained_for`)
            _scontrol("update", f"NodeName={node}", "State=DRAIN", f"Reason={want}")
            judged.drained_for = verdict.xids
            return f"drain reason now: {want}"
        _scontrol("update", f"NodeName={node}", "State=DRAIN", f"Reason={want}")
        if judged is not None:  # drained: a later resume is for these (not before: a
            judged.drained_for = verdict.xids  # failed drain read as a resume)
        return f"drained {node}: {want}"
    if verdict.status == OK and "DRAIN" in state and reason.startswith(REASON_PREFIX):
        _scontrol("update", f"NodeName={node}", "State=RESUME")
        return f"resumed {node} (was: {reason})"
    return ""


EXAMPLES = """\
exit status: 0 healthy, 1 problem (the node should not run jobs), 2 unknown (the agent
did not answer or answered something else: never a reason to drain; --drain leaves
Slurm untouched then).

examples:
  # ask the local agent; print OK or the reasons
  clusterpulse-healthcheck --agent http://127.0.0.1:9477

  # drain on a problem, resume the node when healthy again if this check drained it
  clusterpulse-healthcheck --drain
  # the same as Slurm's HealthCheckProgram (deploy/slurm/healthcheck.sh)
  clusterpulse-healthcheck --drain --detach

  # as a Kubernetes Node Problem Detector custom plugin
  # (deploy/kubernetes/node-problem-detector/)
  clusterpulse-healthcheck --agent http://127.0.0.1:9477 --timeout 5

  # also treat XID 13 as critical, tolerate no stale collection over 30 s
  clusterpulse-healthcheck --xid 13 --max-age 30

  # after resetting a GPU for its XID (where no Slurm resume says so): those are done
  clusterpulse-healthcheck --acknowledge
"""


def _xid(text: str) -> int:
    try:
        code = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"XID must be a number, got {text!r}") from None
    if not 0 < code < 1000:
        raise argparse.ArgumentTypeError(f"XID must be in 1..999, got {code}")
    return code


# A health check that waits longer for its own node's agent is hung, not checking.
MAX_TIMEOUT_S = 3600.0
# The agent's state directory in the shipped units (systemd StateDirectory, the
# DaemonSet's hostPath): the check runs on the same node, as root under slurmd.
DEFAULT_STATE = "/var/lib/clusterpulse/healthcheck.json"


def build_parser() -> argparse.ArgumentParser:
    env = os.environ
    p = argparse.ArgumentParser(
        prog="clusterpulse-healthcheck", epilog=EXAMPLES,
        description="Node health check for Slurm (HealthCheckProgram, NHC-style) and "
        "Kubernetes Node Problem Detector: reads the local ClusterPulse agent's metrics.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--agent", default=env.get("CLUSTERPULSE_AGENT_URL", "http://127.0.0.1:9477"),
                   help="agent base URL (env CLUSTERPULSE_AGENT_URL; "
                   "default http://127.0.0.1:9477)")
    p.add_argument("--timeout", type=float, default=5.0,
                   help="seconds to wait for the agent (default 5)")
    p.add_argument("--max-age", type=float, default=60.0,
                   help="a last GPU collection older than this many seconds is a problem "
                   "(default 60)")
    p.add_argument("--xid", type=_xid, action="append", default=[],
                   help="treat this XID as critical too (repeatable); default set: "
                   + ",".join(map(str, sorted(CRITICAL_XIDS))))
    p.add_argument("--ecc-max", type=float, default=0,
                   help="uncorrectable ECC errors tolerated per GPU (default 0)")
    p.add_argument("--drain", action="store_true",
                   help="drain this node in Slurm on a problem (and resume it once healthy "
                   "if this check drained it)")
    p.add_argument("--detach", action="store_true",
                   help="with --drain: update Slurm from a detached child and exit at once. "
                   "Needed as HealthCheckProgram: slurmd waits for the program while "
                   "slurmctld waits for slurmd, so a synchronous scontrol stalls until "
                   "timeouts (what NHC's detached mode is for)")
    p.add_argument("--node", default=env.get("SLURMD_NODENAME") or socket.gethostname(),
                   help="Slurm node name for --drain (default: $SLURMD_NODENAME, "
                   "else the hostname)")
    p.add_argument("--state", default=env.get("CLUSTERPULSE_HEALTHCHECK_STATE", DEFAULT_STATE),
                   help="file of the XIDs already dealt with (a reboot, an operator's "
                   "resume of a node this check drained, --acknowledge): only newer ones "
                   "are a problem. 'none': every XID ever counted is (env "
                   f"CLUSTERPULSE_HEALTHCHECK_STATE; default {DEFAULT_STATE})")
    p.add_argument("--acknowledge", action="store_true",
                   help="the GPUs' XIDs counted so far are dealt with (after a GPU reset, "
                   "or under Node Problem Detector, where no resume says so); then check")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    # `not 0 < x <= limit`: NaN fails every comparison (settimeout raised on it), and an
    # endless --timeout overflowed the socket's deadline into a traceback, exit 1, where
    # a check that cannot run is "unknown" (2)
    if not 0 < a.timeout <= MAX_TIMEOUT_S:
        p.error(f"--timeout must be > 0 and at most {MAX_TIMEOUT_S:g} seconds, got {a.timeout:g}")
    if not 0 < a.max_age < math.inf:
        p.error(f"--max-age must be a number of seconds > 0, got {a.max_age:g}")
    if not a.ecc_max >= 0:
        p.error("--ecc-max must be a count >= 0")
    try:
        parts = urllib.parse.urlsplit(a.agent)
        parts.port  # noqa: B018 - raises ValueError for a port that is not one
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        p.error(f"--agent must be an http:// or https:// URL, got {a.agent!r}")
    if a.acknowledge and a.state == "none":
        p.error("--acknowledge needs a --state file to keep it in")
    state = None if a.state == "none" else Path(a.state)
    # slurmd waits for the program (--detach: the drain's child keeps the lock, and a
    # check that waited its full minute behind a stuck one stalled slurmd that long)
    lock = hold_lock(state, 5.0 if a.detach else 60.0) if state is not None else None
    try:
        return _run(a, state, lock)
    finally:
        if lock is not None:
            os.close(lock)  # a detached child keeps its own copy until it is done


def _run(a: argparse.Namespace, state: Path | None, lock: int | None) -> int:
    url = a.agent.rstrip("/") + "/metrics"
    judged = XidJudged.load(state) if state is not None else None
    if state is not None and lock is None:
        print(f"clusterpulse-healthcheck: cannot lock {state} (another check holds it, or "
              "it cannot be made): judging without keeping what is judged", file=sys.stderr)
        if a.acknowledge:  # it would be lost
            print("clusterpulse-healthcheck: error: nothing acknowledged", file=sys.stderr)
            return UNKNOWN
        state = None
    if judged is not None:
        judged.after_boot(boot_id())
    page = read_page(url, a.timeout)
    xids = CRITICAL_XIDS | frozenset(a.xid)

    latest: list[Verdict] = []  # the last verdict judged (after a resume, a new one)

    def judge() -> Verdict:
        v = page if isinstance(page, Verdict) else \
            evaluate(page, time.time(), a.max_age, xids, a.ecc_max, judged)
        latest.append(v)
        return v

    verdict = judge()
    if a.acknowledge and judged is not None and verdict.status != UNKNOWN:
        judged.acknowledge(verdict.xids)
        done = [f"{u} XID {c} x{n}" for u, codes in sorted(verdict.xids.items())
                for c, n in sorted(codes.items())]
        print(f"acknowledged: {', '.join(done) or 'no XID counted'}", flush=True)
        verdict = judge()
    if not (a.drain and not a.detach):  # decided now: slurmd ignores the status
        _say(verdict)
    if a.drain and a.detach:
        if os.fork() != 0:
            return verdict.status
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):  # slurmd reads our output until EOF: release it
            os.dup2(devnull, fd)
        failed = 0
        try:
            apply_to_slurm(a.node, verdict, judged, judge)
        except (SlurmError, subprocess.TimeoutExpired):
            failed = 1
        _keep(judged, state, verdict)
        os._exit(failed)
    if a.drain:
        try:
            done = apply_to_slurm(a.node, verdict, judged, judge)
        except (SlurmError, subprocess.TimeoutExpired) as err:
            _say(latest[-1])
            print(f"clusterpulse-healthcheck: cannot update Slurm: {err}", file=sys.stderr)
            _keep(judged, state, verdict)
            return latest[-1].status or UNKNOWN
        verdict = latest[-1]  # judged again after an operator's resume
        _say(verdict)
        if done:
            print(f"clusterpulse-healthcheck: {done}", file=sys.stderr)
    _keep(judged, state, verdict)
    return verdict.status


def _say(verdict: Verdict) -> None:
    print(verdict.message if verdict.status == OK else
          f"ERROR: clusterpulse-healthcheck: {verdict.message}", flush=True)


def _keep(judged: XidJudged | None, state: Path | None, verdict: Verdict) -> None:
    """Save what this run judged; an agent that did not answer changes nothing seen."""
    if judged is None or state is None:
        return
    if verdict.status != UNKNOWN:
        judged.seen = verdict.xids
    try:
        judged.save(state)
    except OSError as err:
        print(f"clusterpulse-healthcheck: cannot keep {state} ({err.strerror or err}): XIDs "
              "already dealt with may be judged again", file=sys.stderr)


if __name__ == "__main__":
    raise SystemExit(main())
