"""clusterpulse-detect: straggler detection offline, with the in-band code."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from clusterpulse.detection.replay import REQUIRED, TraceError, read_rows, replay
from clusterpulse.detection.scoring import ScoringConfig

EXAMPLES = f"""\
examples:
  # every flag of a recorded run, one JSON object per line
  clusterpulse-detect replay run-42.csv
  # as the trainer scores with --consensus-every 10, and stricter
  clusterpulse-detect replay run-42.csv --every 10 --z 6
  # only the ranks of one node
  clusterpulse-detect replay run-42.parquet | jq 'select(.node == "gpu-node-017")'

trace columns: {", ".join(REQUIRED)}
  optional: group (peer group, e.g. pipeline stage), comm_seconds, comm_bytes,
  clock_ratio, thermal, power_brake, hw_slowdown, gpu_idle, utilization, xid_recent,
  ecc_uncorrected_recent
output: {{"run", "rank", "node", "step", "peer_score", "self_score", "cause"}} per flag
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="clusterpulse-detect",
        description="Straggler detection offline: replays a per-rank step trace through "
        "the same scoring the trainer runs in-band and prints each flag as a JSON line.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("replay", help="replay a trace (CSV, or Parquet with pyarrow)",
                       epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("trace", type=Path, help="CSV or Parquet file, one row per rank per step")
    d = ScoringConfig()
    r.add_argument("--every", type=int, default=d.every,
                   help=f"steps between evaluations, as --consensus-every (default {d.every})")
    r.add_argument("--window", type=int, default=d.window,
                   help=f"steps averaged per score (default {d.window})")
    r.add_argument("--self-threshold", type=float, default=d.self_threshold,
                   help=f"slowdown against the rank's own history (default {d.self_threshold})")
    r.add_argument("--z", type=float, default=d.z,
                   help=f"noise standard deviations a slowdown must exceed (default {d.z})")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = ScoringConfig(every=args.every, window=args.window,
                               warmup_steps=max(ScoringConfig().warmup_steps, args.window),
                               self_threshold=args.self_threshold, z=args.z)
        config.validate()
        for flag in replay(read_rows(args.trace), config, source=str(args.trace)):
            print(json.dumps(flag.as_dict()), flush=True)
    except (TraceError, ValueError) as err:
        print(f"clusterpulse-detect: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `| head`: the reader has what it wants
        return 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
