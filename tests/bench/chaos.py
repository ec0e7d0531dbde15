"""Chaos benchmark: a multi-node job on the testbed under a random fault every 3-5 min,
remediation on, against the same job with no faults, in one invocation (`make chaos`).

    python -m tests.bench.chaos --minutes 30 --seed 1      # needs root (the testbed)

With `--spares N` (default 1) the testbed has N nodes more than the job's size, the
job (elastic, one node below its size at least) is started on all of them and the
rendezvous keeps N standing by (trainer/launch.py, hot spares); the remediation
then follows deploy/local/policy-spares.toml, which takes a slowed node out at once
since a spare takes its place. Faults fall on the job's nodes, never on a standby.

Reports, per fault: time to detect (first matching alert's activeAt), time to recover
(first step past the step the job had reached at the fault), steps recomputed; faults
missed; false alerts (alerts no fault explains, baseline included); goodput of both
runs (productive step time / wall time, productive = the steps kept at the end, timed
at the no-fault run's median step time) and, start-up excluded, the kept steps per
second relative to the no-fault run; and whether a checkpoint was
ever lost (a resume from older than the newest checkpoint committed before the fault).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import re
import signal
import sys
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path

from clusterpulse.dashboard.remediation import Policy
from deploy.local.stack import REPO
from deploy.testbed import Testbed, TestbedError, missing_privileges
from deploy.testbed.cluster import ClusterTarget, TestbedCluster
from deploy.testbed.faults import EXPECT, Fault, Observer, Outcome, play, undo

KINDS = ["gpu_overheat", "gpu_lost", "rank_hang", "rank_crash", "agent_kill", "node_death",
         "partition", "slow_link"]
TRANSIENT = {"gpu_overheat": 120, "gpu_lost": 60, "partition": 30, "slow_link": 60,
             "agent_kill": 20, "node_death": 60}
CKPT_EVERY = 50
STEP_S = 0.1  # simulated GPU time of a step with every node in
RESUMED = re.compile(r"trainer: resumed from step-(\d+)")
SPARES_POLICY = REPO / "deploy" / "local" / "policy-spares.toml"


@dataclass
class RunResult:
    run: str
    wall_s: float
    final_step: int
    mean_step_s: float
    train_s: float = 0.0  # wall time from the first step on (without the job's start-up)
    outcomes: list[Outcome] = field(default_factory=list)
    alerts: list[tuple[str, str, float, str]] = field(default_factory=list)  # name,node,t,run
    lost_checkpoints: list[str] = field(default_factory=list)


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def trainer_args(steps: int, batch: int, nodes: int) -> list[str]:
    """100 ms of simulated GPU time per step with every node in (one rank per node), as
    a cost per sequence: on one node fewer (elastic) each rank takes a larger share of
    the fixed global batch and a longer step, as GPUs would (a fixed pad let the
    smaller job step as fast)."""
    per_sequence = STEP_S * nodes / batch
    return ["--preset", "tiny", "--steps", str(steps), "--global-batch", str(batch),
            "--ckpt-every", str(CKPT_EVERY), "--async-ckpt",
            "--sim-sample-seconds", f"{per_sequence:.6f}", "--log-every", "200"]


def draw_faults(rng: random.Random, minutes: float, every: tuple[float, float],
                nodes: int) -> list[tuple[float, Fault]]:
    """(offset seconds, fault) pairs: the first after one interval, then every U(every)."""
    out, t = [], rng.uniform(*every)
    while t < minutes * 60 - 60:  # leave a minute to see the last one recover
        kind = rng.choice(KINDS)
        node = rng.randrange(1, nodes)  # node 0 hosts the rendezvous: faults spare it
        out.append((t, Fault(kind, node, gpu=0, seconds=TRANSIENT.get(kind, 0))))
        t += rng.uniform(*every)
    return out


def alert_episodes(obs: Observer, start: float, end: float,
                   ) -> list[tuple[str, str, float, str]]:
    """Every firing episode of every alert between start and end concerning this run or
    no run (node alerts): (name, node, start, run). Alerts of an earlier, stopped run
    (the agents keep its ranks for --rank-grace) are not this run's."""
    q = urllib.parse.urlencode({"query": 'ALERTS{alertstate="firing"}', "start": f"{start:.0f}",
                                "end": f"{end:.0f}", "step": "2"})
    with urllib.request.urlopen(f"{obs.prometheus}/api/v1/query_range?{q}", timeout=30) as r:
        series = json.load(r)["data"]["result"]
    out = []
    for s in series:
        last = None
        for t, _ in s["values"]:
            if last is None or t - last > 4:
                out.append((s["metric"]["alertname"], s["metric"].get("node", ""), float(t),
                            s["metric"].get("run", "")))
            last = t
    return sorted((a for a in out if a[3] in ("", obs.run)), key=lambda a: a[2])


def on_the_job(fault: Fault, cl: TestbedCluster, run: str) -> Fault:
    """The fault, moved to the next node of the job (never node0, which hosts the
    rendezvous) if the drawn one has no rank of it now: a standby, a node sitting out.
    A fault on an idle node would cost the job nothing."""
    names = [n.name for n in cl.bed.nodes]
    in_job = set(cl.job_nodes(run))
    for i in range(len(names) - 1):
        node = 1 + (fault.node - 1 + i) % (len(names) - 1)
        if names[node] in in_job:
            return replace(fault, node=node)
    return fault


def run_job(cl: TestbedCluster, run: str, minutes: float, faults: list[tuple[float, Fault]],
            batch: int, size: int, spares: int) -> RunResult:
    job = cl.start_job(run, trainer_args(10**7, batch, size), min_nodes=size - 1,
                       max_restarts=100, spares=spares)
    obs = Observer(cl.central.prometheus, cl.state / "audit.jsonl", run,  # type: ignore[union-attr]
                   Policy.load(cl.policy))
    target = ClusterTarget(cl, run)
    names = [n.name for n in cl.bed.nodes]
    start = time.time()
    end = start + minutes * 60
    pending = list(faults)
    active: list[Outcome] = []
    undone: set[int] = set()
    committed: list[tuple[float, int]] = []  # (seen at, newest committed checkpoint step)
    resumes: list[tuple[float, int]] = []
    seen_lines: dict[str, int] = {}
    last_progress = 0.0
    first_step_at = None
    result = RunResult(run, 0, 0, 0)
    while time.time() < end:
        now = time.time()
        if pending and now - start >= pending[0][0]:
            _, fault = pending.pop(0)
            fault = on_the_job(fault, cl, run)
            try:
                play(fault, target)
                o = Outcome(fault)
                active.append(o)
                result.outcomes.append(o)
                say(f"{run}: fault {len(result.outcomes)}: {fault.describe(names)}")
            except (RuntimeError, OSError, TestbedError) as err:
                say(f"{run}: could not play {fault.kind} on {names[fault.node]}: {err}")
        for o in active:
            with contextlib.suppress(OSError):
                obs.update(o, names[o.fault.node])
            if id(o) not in undone and o.fault.kind in TRANSIENT and \
                    now - o.fault.at >= o.fault.seconds and o.fault.kind not in (
                        "gpu_overheat", "gpu_lost"):  # the agent ends those by itself
                undo(o.fault, target)
                undone.add(id(o))
        steps = sorted(int(p.name.split("-")[1]) for p in job.ckpt_dir.glob("step-*")
                       if (p / ".metadata").exists() or (p / "manifest.json").exists())
        if steps:
            committed.append((now, steps[-1]))
        for log in cl.state.glob(f"{run}-*.log"):
            text = log.read_text(errors="replace")
            for m in RESUMED.finditer(text, seen_lines.get(log.name, 0)):
                resumes.append((now, int(m.group(1))))
            seen_lines[log.name] = len(text)
        if first_step_at is None:
            with contextlib.suppress(OSError):
                if (obs.step() or 0) > 0:
                    first_step_at = now
        if now - last_progress >= 30:
            last_progress = now
            step = obs.step()
            say(f"{run}: {(now - start) / 60:.1f}/{minutes:.0f} min, step {step}, "
                f"{len(result.outcomes)} fault(s) so far")
        time.sleep(1)
    for o in active:  # leave nothing shaped or cut for the next run
        if id(o) not in undone and o.fault.kind in ("partition", "slow_link", "agent_kill",
                                                    "node_death"):
            undo(o.fault, target)
    result.wall_s = time.time() - start
    result.train_s = time.time() - (first_step_at or start)
    result.final_step = obs.step() or 0
    r = obs.query(f'quantile_over_time(0.5, max(clusterpulse_trainer_step_seconds'
                  f'{{run="{run}"}})[{int(result.wall_s)}s:1s])')
    result.mean_step_s = float(r[0]["value"][1]) if r else float("nan")
    result.alerts = alert_episodes(obs, start, time.time())
    for o in result.outcomes:  # a resume after the fault from older than what was committed
        before = [s for t, s in committed if t <= o.fault.at]
        after = [s for t, s in resumes if t >= o.fault.at and (o.recovered_at is None or
                                                                t <= o.recovered_at + 5)]
        if before and after and min(after) < before[-1]:
            result.lost_checkpoints.append(
                f"{o.fault.kind}: resumed from {min(after)}, {before[-1]} was committed")
    stop_job(cl, run)
    return result


def stop_job(cl: TestbedCluster, run: str) -> None:
    job = cl.jobs.pop(run)
    for node in cl.bed.nodes:
        # launchers and torchruns frozen first (no rank forked after the look), then
        # the ranks found under them, then all of it
        launchers = cl.bed.find(node, "-m", "clusterpulse.trainer", f"--run-id {run} ")
        for pid in launchers:
            cl.bed.kill_process(pid, signal.SIGSTOP)
        for pid in cl.rank_pids(node, run) + launchers:
            cl.bed.kill_process(pid, signal.SIGKILL)
    for p in job.procs.values():
        p.wait()  # type: ignore[attr-defined]


def explained(alert: tuple[str, str, float, str], outcomes: list[Outcome],
              names: list[str]) -> bool:
    """An alert is explained by a fault on its node (or a run-level alert by any fault)
    that started before it and within the fault's duration plus three minutes."""
    name, node, t, _run = alert
    for o in outcomes:
        if o.fault.at - 5 <= t <= o.fault.at + o.fault.seconds + 180 and \
                (not node or node == names[o.fault.node] or name in ("RankHung", "JobStalled",
                                                                     "TrainingStraggler")):
            return True
    return False


def report(base: RunResult, chaos: RunResult, names: list[str], args: argparse.Namespace,
           ) -> str:
    lines = [f"Chaos benchmark: a job of {args.nodes} nodes x 1 rank on {len(names)} nodes "
             f"({args.spares} standing by), {args.baseline_minutes:g} min "
             f"without faults, then {args.minutes:g} min with, seed {args.seed}, fault every "
             f"{args.every[0]:.0f}-{args.every[1]:.0f} s", "",
             "| # | fault | node | detected by | detect s | action | recover s | "
             "steps recomputed |", "|---|---|---|---|---|---|---|---|"]
    missed = 0
    for i, o in enumerate(chaos.outcomes, 1):
        expect_alerts = EXPECT[o.fault.kind]
        if expect_alerts and o.detected_at is None:
            missed += 1
        lines.append(f"| {i} | {o.fault.kind} | {names[o.fault.node]} | "
                     f"{o.alert or ('MISSED' if expect_alerts else '(no alert expected)')} | "
                     f"{_f(o.detect_s)} | {o.action or '-'} | {_f(o.recover_s)} | "
                     f"{o.recomputed if o.recomputed is not None else '-'} |")
    false_base = base.alerts
    false_chaos = [a for a in chaos.alerts if not explained(a, chaos.outcomes, names)]
    g_base = base.final_step * base.mean_step_s / base.wall_s if base.wall_s else 0
    g_chaos = chaos.final_step * base.mean_step_s / chaos.wall_s if chaos.wall_s else 0
    rate_base = base.final_step / base.train_s if base.train_s else 0
    rate_chaos = chaos.final_step / chaos.train_s if chaos.train_s else 0
    lines += ["", f"- faults: {len(chaos.outcomes)}, missed: {missed}",
              f"- false alerts: {len(false_chaos)} in the chaos run "
              f"({', '.join(sorted({a[0] for a in false_chaos})) or 'none'}), "
              f"{len(false_base)} in the no-fault run "
              f"({', '.join(sorted({a[0] for a in false_base})) or 'none'})",
              f"- steps: {chaos.final_step} with faults vs {base.final_step} without "
              f"(median step {base.mean_step_s * 1000:.0f} ms without faults)",
              f"- goodput (productive step time / wall time): {g_chaos:.1%} with faults, "
              f"{g_base:.1%} without; ratio {g_chaos / g_base if g_base else float('nan'):.3f} "
              f"(wall time from launch, {chaos.wall_s:.0f} s and {base.wall_s:.0f} s)",
              f"- kept steps per second from the first step on (start-up excluded): "
              f"{rate_chaos:.2f} with faults, {rate_base:.2f} without; goodput relative to "
              f"the no-fault run {rate_chaos / rate_base if rate_base else float('nan'):.1%}",
              f"- checkpoints lost: {len(chaos.lost_checkpoints)}"
              + (f" ({'; '.join(chaos.lost_checkpoints)})" if chaos.lost_checkpoints else "")]
    return "\n".join(lines)


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def parse_every(text: str) -> tuple[float, float]:
    try:
        lo, hi = (float(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--every wants MIN:MAX seconds, got {text!r}") from None
    if not 10 <= lo <= hi:
        raise argparse.ArgumentTypeError("--every: need 10 <= MIN <= MAX")
    return lo, hi


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.bench.chaos", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="examples:\n  make chaos\n  python -m tests.bench.chaos "
                                "--minutes 8 --seed 3 --state-dir /tmp/chaos")
    p.add_argument("--minutes", type=float, default=30, help="per run (default: 30)")
    p.add_argument("--baseline-minutes", type=float,
                   help="the no-fault run's length (default: --minutes). Its steady step "
                        "rate is what the chaos run is held against; the goodput that "
                        "counts start-up favours the longer run")
    p.add_argument("--seed", type=int, default=1, help="fault draw (default: 1)")
    p.add_argument("--nodes", type=int, default=4, help="the job's size (default: 4)")
    p.add_argument("--spares", type=int, default=1,
                   help="testbed nodes beyond the job's size, standing by (default: 1)")
    p.add_argument("--every", type=parse_every, default=(180.0, 300.0),
                   help="seconds between faults, MIN:MAX (default: 180:300)")
    p.add_argument("--state-dir", type=Path, default=Path("/tmp/clusterpulse-chaos"),
                   help="each invocation keeps its logs, Prometheus data and checkpoints in "
                   "a new directory under this one (default: /tmp/clusterpulse-chaos)")
    p.add_argument("--out", type=Path, help="also write the report (Markdown) here")
    args = p.parse_args(argv)
    args.baseline_minutes = args.baseline_minutes or args.minutes
    if min(args.minutes, args.baseline_minutes) < 2 or not 2 <= args.nodes <= 16 \
            or not 0 <= args.spares <= 4:
        p.error("--minutes and --baseline-minutes must be >= 2, --nodes in 2..16 and "
                "--spares in 0..4")
    reason = missing_privileges()
    if reason:
        print(f"chaos: {reason}", file=sys.stderr)
        return 2
    rng = random.Random(args.seed)
    # A directory of its own: jobs named as an earlier invocation's would resume from its
    # checkpoints (a baseline "starting" at step 4,700 counts steps it never made).
    state = args.state_dir / time.strftime("%Y%m%d-%H%M%S")
    state.mkdir(parents=True)
    batch = args.nodes * (args.nodes - 1)  # divisible by the world size with one node fewer
    try:
        with Testbed(nodes=args.nodes + args.spares) as bed, \
                TestbedCluster(bed, state, scrape_interval="1s",
                               policy=SPARES_POLICY if args.spares else None) as cl:
            names = [n.name for n in bed.nodes]
            # drawn over the job's size: the same faults for a seed with or without
            # spares (a fault drawn for a standby moves to a node of the job)
            faults = draw_faults(rng, args.minutes, args.every, args.nodes)
            if bed.sysctl_missing:
                say(f"this kernel lacks the node tuning's {', '.join(bed.sysctl_missing)}: "
                    "partitions recover at TCP's uncapped backoff")
            say(f"testbed {bed.prefix} up, state in {state}: {', '.join(names)}; "
                f"{len(faults)} faults drawn: "
                + ", ".join(f"{f.kind}@{t:.0f}s" for t, f in faults))
            say("baseline run (no faults) ...")
            base = run_job(cl, "baseline", args.baseline_minutes, [], batch, args.nodes,
                           args.spares)
            say(f"baseline: step {base.final_step} in {base.wall_s:.0f} s; chaos run ...")
            chaos = run_job(cl, "chaos", args.minutes, faults, batch, args.nodes, args.spares)
    except TestbedError as err:
        print(f"chaos: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("chaos: interrupted; testbed removed", file=sys.stderr)
        return 130
    text = report(base, chaos, names, args)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
