"""`python -m deploy.testbed`: bring a testbed up by hand, list runs, clean up leftovers."""

from __future__ import annotations

import argparse
import signal
import sys
import time

from deploy.testbed import net
from deploy.testbed.bed import Testbed
from deploy.testbed.net import TestbedError

EXAMPLES = """\
examples:
  python -m deploy.testbed up --nodes 4       # build 4 nodes, print them, hold until Ctrl-C
  python -m deploy.testbed list               # runs on this machine and their owners
  python -m deploy.testbed cleanup            # remove what runs whose owner died left
  python -m deploy.testbed cleanup --all      # remove every testbed run, live or not
  # a shell on a node of a running testbed:
  nsenter --net=/run/netns/tb1a2b-node0 --uts=/run/clusterpulse-testbed/tb1a2b-node0.uts bash
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deploy.testbed", description=__doc__,
                                epilog=EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="build a testbed and hold it until Ctrl-C/SIGTERM")
    up.add_argument("--nodes", type=int, default=4, help="nodes (default: 4)")
    sub.add_parser("list", help="registered runs and whether their owner lives")
    clean = sub.add_parser("cleanup", help="remove leftovers of dead runs")
    clean.add_argument("--all", action="store_true", help="also remove runs whose owner lives")
    args = p.parse_args(argv)
    try:
        if args.cmd == "up":
            # "Ctrl-C removes it" also when started in the background of a script: such
            # jobs inherit SIGINT ignored, and Python then never raises KeyboardInterrupt.
            signal.signal(signal.SIGINT, signal.default_int_handler)
            with Testbed(nodes=args.nodes) as bed:
                print(f"testbed {bed.prefix}: bridge {bed.bridge} {bed.bridge_ip}/24")
                for n in bed.nodes:
                    print(f"  {n.name:8s} {n.ip:15s} netns {n.netns}  link {n.host_veth}")
                print("Ctrl-C removes it.", flush=True)
                while True:
                    time.sleep(3600)
        if args.cmd == "list":
            for r in net.registered_runs():
                alive = net.process_alive(int(r.get("owner_pid", 0)), r.get("owner_start"))
                print(f"{r['prefix']}  {r.get('subnet')}  nodes={r.get('nodes')}  "
                      f"owner={r.get('owner_pid')} ({'alive' if alive else 'dead'})")
            return 0
        reason = net.missing_privileges()
        if reason:
            raise TestbedError(reason)
        prefixes = ([r["prefix"] for r in net.registered_runs()] if args.all else [])
        for prefix in sorted(set(prefixes) | set(net.dead_runs())):
            removed = net.remove_run(prefix)
            print(f"{prefix}: removed {len(removed)} item(s)" + (
                f": {', '.join(removed)}" if removed else ""))
        return 0
    except TestbedError as err:
        print(f"testbed: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
