"""`clusterpulse-agent`: the per-node daemon."""

from __future__ import annotations

import argparse
import functools
import logging
import os
import re
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from clusterpulse.agent import __version__, protocol
from clusterpulse.agent.attribution import GpuAttribution
from clusterpulse.agent.audit import AuditLog
from clusterpulse.agent.backends import Backend, BackendError
from clusterpulse.agent.faults import FaultError, load_scenario
from clusterpulse.agent.httpsafe import listen_address, tls_context
from clusterpulse.agent.identity import still_running
from clusterpulse.agent.logsetup import setup_logging
from clusterpulse.agent.ranks import RankRegistry, RankState
from clusterpulse.agent.tokens import TokenError, Tokens

if TYPE_CHECKING:
    from clusterpulse.agent.podresources import PodResources

log = logging.getLogger("clusterpulse.agent")

EXAMPLES = """\
examples:
  # 8 simulated H100s (no GPU needed), metrics at http://127.0.0.1:9477/metrics
  clusterpulse-agent --backend sim --gpus 8 --listen 127.0.0.1:9477

  # real GPUs through NVML, control API on with a token, reachable by Prometheus
  clusterpulse-agent --backend nvml --listen 0.0.0.0:9477 --token-file /etc/clusterpulse/token

  # telemetry socket of one node among several on a host (ranks: --agent unix:/run/cp/a.sock)
  clusterpulse-agent --backend sim --node a --telemetry unix:/run/cp/a.sock

  # control API over TLS, one token per client (lines 'NAME TOKEN'; see docs/security.md)
  clusterpulse-agent --backend nvml --listen 0.0.0.0:9477 --token-file /etc/clusterpulse/tokens \\
      --tls-cert /etc/clusterpulse/agent.crt --tls-key /etc/clusterpulse/agent.key

  # a node whose fabric link is a veth or macvlan (read besides device-backed NICs)
  clusterpulse-agent --backend nvml --nic eth0 --nic 'ib*'

  # Kubernetes: label each GPU with the pod holding it (needs clusterpulse[kubernetes])
  clusterpulse-agent --backend nvml \\
      --pod-resources unix:///var/lib/kubelet/pod-resources/kubelet.sock

  # simulated node with a timed fault scenario (TOML, see deploy/local/scenario.toml)
  clusterpulse-agent --backend sim --node sim-a --scenario deploy/local/scenario.toml
"""


class UsageError(Exception):
    """Bad command-line input; printed as one line, exit code 2."""


# A node's name as hosts, Kubernetes and Slurm give it. A quote or a backslash would
# break the alert templates that query the node's evidence by its label.
NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,252}")


# The longest --interval or --rank-grace. A week already means no monitoring (or ranks
# never forgotten); an --interval of inf, or of 1e300, reached the collection thread's
# wait, which raised OverflowError past threading.TIMEOUT_MAX: the thread died and the
# GPU data never changed again, while the agent still served it.
MAX_SECONDS = 7 * 86400.0


def check_seconds(flag: str, value: float) -> None:
    """Refuse a duration outside (0, MAX_SECONDS]. Written `not 0 < x <= max`: NaN
    fails every comparison, so it is refused too (`x <= 0` let it through, and an
    --interval of NaN spun a core)."""
    if not 0 < value <= MAX_SECONDS:
        raise UsageError(f"{flag} must be > 0 and at most {MAX_SECONDS:g} seconds "
                         f"(a week), got {value:g}")


def read_token(path: Path) -> Tokens:
    try:
        tokens, shared = Tokens.load(path)
    except TokenError as err:
        raise UsageError(str(err)) from None
    if shared:
        log.warning("token file %s is readable by other users; chmod 600 it", path)
    return tokens


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="clusterpulse-agent",
        description="Per-node agent: reads GPUs (NVML or simulated), receives trainer "
        "telemetry, serves Prometheus metrics and an authenticated control API.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--backend", choices=["auto", "nvml", "sim"], default="auto",
                   help="GPU source; auto = NVML when a driver is present (default: auto)")
    p.add_argument("--node", default=socket.gethostname(),
                   help="node label on every series: a host name (letters, digits, "
                        "'.', '-', '_', ':') (default: hostname)")
    # 9477, not 9400: dcgm-exporter, often on the same GPU nodes, owns 9400.
    p.add_argument("--listen", default="127.0.0.1:9477",
                   help="HTTP address for /metrics and /v1/ (default: 127.0.0.1:9477)")
    p.add_argument("--telemetry", default=protocol.DEFAULT_TELEMETRY,
                   help="where ranks send telemetry: unix:/PATH, a Unix SOCK_SEQPACKET socket (a "
                   "connection per rank) whose senders the kernel identifies (default: "
                   "%(default)s), or HOST:PORT for UDP, whose senders are unauthenticated "
                   "and never signalled (docs/agent.md#telemetry-address)")
    p.add_argument("--interval", type=float, default=1.0,
                   help="seconds between GPU collections, at most a week (default: 1)")
    p.add_argument("--gpus", type=int, default=8, help="simulated GPUs (default: 8)")
    p.add_argument("--gpu-model", default="H100", help="simulated model: H100, H200, A100")
    p.add_argument("--scenario", type=Path, help="TOML file of timed simulated faults")
    p.add_argument("--token-file", type=Path,
                   help="file holding the control API bearer token; without it the API is off")
    p.add_argument("--tls-cert", type=Path,
                   help="PEM certificate: serve /metrics and /v1/ over HTTPS (with --tls-key)")
    p.add_argument("--tls-key", type=Path, help="PEM private key of --tls-cert")
    p.add_argument("--max-connections", type=int, default=64,
                   help="HTTP requests served at once (connections still sending their "
                   "request wait apart and hold none); more get 503 (default: 64)")
    p.add_argument("--audit-log", type=Path, help="JSON-lines audit log of control actions")
    p.add_argument("--state-dir", type=Path,
                   help="directory for state that must survive agent restarts (XID counts and "
                   "the GPUs seen with --remember-gpus, NVML backend; docs/agent.md); e.g. "
                   "/var/lib/clusterpulse. Default: none (counts restart "
                   "at zero, so an XID just after an agent restart can be missed)")
    p.add_argument("--remember-gpus", action="store_true",
                   help="remember the node's GPUs by UUID in --state-dir (gpus.json) and "
                   "report one that is missing at start down: only for the agent that sees "
                   "every GPU of the node (the DaemonSet, the systemd unit), never for one "
                   "scoped to a job's or a container's GPUs, which would report the others "
                   "down (docs/agent.md). Default: off")
    p.add_argument("--sysfs", type=Path, default=Path("/sys"),
                   help="sysfs root for NIC port health (InfiniBand/RoCE counters, Ethernet "
                   "statistics); it also tells device-backed NICs from virtual ones. "
                   "'none' to turn it off: then only the --nic interfaces' queues are read "
                   "(default: /sys)")
    p.add_argument("--nic", action="append", default=[], metavar="IFACE",
                   help="network interface to read (counters and queue) besides the NICs "
                   "backed by a device and the RDMA ports, which are always read; a name or "
                   "a glob ('ens*'), repeat for several. veths, bridges, tun/tap, docker, "
                   "cni, calico and flannel devices are read only when named here")
    p.add_argument("--no-queues", action="store_true",
                   help="do not read the NICs' queue statistics (they need `tc`, iproute2)")
    p.add_argument("--pod-resources", metavar="unix:///PATH",
                   help="the kubelet's PodResources socket: export which pod, namespace and "
                   "container holds each GPU (clusterpulse_gpu_owner_info), e.g. "
                   "unix:///var/lib/kubelet/pod-resources/kubelet.sock. Needs the "
                   "'kubernetes' extra. Default: off")
    p.add_argument("--proc", type=Path, default=Path("/proc"),
                   help="procfs of the GPU processes' pid namespace, read for their user "
                   "and Slurm job, and for the ranks' sockets (in a container: the host's, "
                   "with hostPID; default: /proc)")
    p.add_argument("--rank-grace", type=float, default=300.0,
                   help="seconds before a silent rank is forgotten, at most a week "
                   "(default: 300)")
    p.add_argument("--max-ranks", type=int, default=1024,
                   help="bound on ranks tracked (default: 1024)")
    p.add_argument("--log-level", default="warning",
                   choices=["debug", "info", "warning", "error"])
    p.add_argument("--version", action="version", version=f"clusterpulse-agent {__version__}")
    return p


def make_backend(args: argparse.Namespace, ranks: RankRegistry) -> Backend:
    from clusterpulse.agent.backends.sim import SimBackend

    if args.remember_gpus and args.state_dir is None:
        raise UsageError("--remember-gpus needs --state-dir (where the GPUs are remembered)")
    if args.backend in ("nvml", "auto"):
        from clusterpulse.agent.backends.nvml import NvmlBackend

        try:
            xid_state = args.state_dir / "xid-counts.json" if args.state_dir else None
            # Only an agent told it sees the whole node keeps the roster: one scoped to
            # a job's GPUs would report every other GPU of the node missing.
            gpu_state = args.state_dir / "gpus.json" if args.remember_gpus else None
            return NvmlBackend(xid_state=xid_state, gpu_state=gpu_state)
        except BackendError as err:
            # NVML's own reason, for auto too: a driver/library mismatch is not "no
            # driver", and a broken driver must not read as a machine without GPUs.
            raise UsageError(str(err)) from None
    scenario = []
    if args.scenario is not None:
        try:
            scenario = load_scenario(args.scenario, args.gpus)
        except FaultError as err:
            raise UsageError(str(err)) from None
    try:
        return SimBackend(gpus=args.gpus, model=args.gpu_model, node=args.node,
                          activity=ranks.activity, scenario=scenario,
                          processes=functools.partial(rank_processes, ranks))
    except ValueError as err:
        raise UsageError(str(err)) from None


def live_ranks(ranks: RankRegistry) -> list[RankState]:
    """The ranks whose process the kernel named and that still runs (a UDP sender's
    process is unknown, and it is left out): the processes the agent may look into."""
    return [r for r in ranks.snapshot() if r.pid > 0 and still_running(r.sender)]


def rank_processes(ranks: RankRegistry, gpu: int) -> tuple[int, ...]:
    """What a driver would list on a simulated GPU: the live rank processes bound to it."""
    return tuple(sorted({r.pid for r in live_ranks(ranks) if r.gpu == gpu}))


def make_pod_resources(target: str | None) -> PodResources | None:
    if target is None:
        return None
    from clusterpulse.agent.podresources import PodResources, PodResourcesUnavailable

    try:
        return PodResources(target)
    except (ValueError, PodResourcesUnavailable) as err:
        raise UsageError(f"--pod-resources: {err}") from None


def make_audit_log(path: Path | None) -> AuditLog:
    """The audit log, refused at start where no file can be: a directory started an
    agent whose every scrape failed, and a path under a file was reported as
    `cannot listen`."""
    try:
        if path is not None and path.is_dir():
            raise UsageError(f"--audit-log {path} is a directory: name a file in it "
                             f"(e.g. {path / 'audit.jsonl'})")
        return AuditLog(path)  # makes its missing directories
    except OSError as err:
        raise UsageError(f"--audit-log {path}: cannot make its directory: "
                         f"{err.strerror or err}") from None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    try:
        return run(args)
    except UsageError as err:
        print(f"clusterpulse-agent: error: {err}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace) -> int:
    from clusterpulse.agent.core import Agent
    from clusterpulse.agent.server import make_server, serve_in_thread

    if not NODE_NAME.fullmatch(args.node):
        raise UsageError(f"--node must be a host name (letters, digits, '.', '-', '_', ':'; "
                         f"at most 253), got {args.node[:300]!r}: the name goes into every "
                         "series and into the alerts' PromQL")
    check_seconds("--interval", args.interval)
    check_seconds("--rank-grace", args.rank_grace)
    if args.max_ranks < 1:
        raise UsageError("--max-ranks must be >= 1")
    try:
        host, port = listen_address(args.listen)
    except ValueError as err:
        raise UsageError(str(err)) from None
    try:
        telemetry = protocol.parse_address(args.telemetry)
    except ValueError as err:
        raise UsageError(f"--telemetry: {err}") from None
    token = read_token(args.token_file) if args.token_file else None
    tls = None
    if bool(args.tls_cert) != bool(args.tls_key):
        raise UsageError("--tls-cert and --tls-key go together")
    if args.tls_cert:
        try:
            tls = tls_context(args.tls_cert, args.tls_key)
        except ValueError as err:
            raise UsageError(str(err)) from None
    if args.max_connections < 1:
        raise UsageError("--max-connections must be >= 1")
    if not (args.proc / "self").is_dir():
        raise UsageError(f"--proc {args.proc} is not a procfs (no {args.proc}/self)")
    audit = make_audit_log(args.audit_log)
    ranks = RankRegistry(max_ranks=args.max_ranks, grace_s=args.rank_grace)
    pods = make_pod_resources(args.pod_resources)
    backend = make_backend(args, ranks)
    agent: Agent | None = None
    try:
        agent = Agent(backend, args.node, ranks, audit, interval_s=args.interval,
                      telemetry_addr=telemetry)
        server = make_server(agent, host, port, token, tls=tls,
                             max_connections=args.max_connections)
    except OSError as err:
        if agent is not None:  # its telemetry socket is bound: closed and removed
            agent.stop()
        else:
            backend.close()
        if pods is not None:
            pods.close()
        raise UsageError(
            f"cannot listen: {err.strerror or err} ({args.listen} / {args.telemetry})"
        ) from None
    from clusterpulse.agent.links import NicCounters, NicSelection, QueueCounters, TcpPeerRtt

    sysfs = None if str(args.sysfs) == "none" else args.sysfs
    nics = NicSelection(tuple(args.nic), sysfs)
    if sysfs is not None:
        agent.links.append(NicCounters(sysfs, nics))
    if not args.no_queues:
        agent.links.append(QueueCounters(nics))
    agent.links.append(TcpPeerRtt(lambda: {(r.pid, r.sender.uid) for r in live_ranks(ranks)},
                                  args.proc))
    agent.links.append(GpuAttribution(lambda: agent.snapshot.gpus, args.proc, pods))
    if pods is not None:
        pods.start()  # a first answer before serving; never blocks past its timeout
    serve_in_thread(server)  # first: /metrics and /v1/ answer whatever NVML does at start
    agent.start()
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    shown = f"[{host}]" if ":" in host else host  # an IPv6 host, as a URL writes it
    print(f"clusterpulse-agent {__version__}: node={args.node} backend={backend.name} "
          f"gpus={len(agent.snapshot.gpus)} "
          f"metrics={'https' if tls else 'http'}://{shown}:{server.server_port}/metrics "
          f"telemetry={agent.telemetry_address} "
          f"control_api={'on' if token else 'off'} pid={os.getpid()}", flush=True)
    done.wait()
    server.shutdown()
    agent.stop()
    if pods is not None:
        pods.close()
    return 0
