"""clusterpulse-audit: check an audit log's hash chain and say where it breaks.

Exit status 0 when the chain is intact (and holds the head given with --head),
1 when it breaks (each break on its own line: line number and why), 2 when the
file cannot be read or an argument is wrong.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from clusterpulse.agent.audit import Head, verify

EXAMPLES = """\
examples:
  clusterpulse-audit verify /var/lib/clusterpulse/audit.jsonl
  # against a head published earlier (the dashboard's Audit page, or the agent's
  # clusterpulse_audit_head_sequence / _hash_prefix metrics: a hex prefix will do)
  clusterpulse-audit verify audit.jsonl --head 1234:5f0c1e9a2b
"""

_HEAD = re.compile(r"^(\d{1,18}):([0-9a-f]{6,64})$")


def _head(text: str) -> tuple[int, str]:
    m = _HEAD.match(text.strip().lower())
    if not m:
        raise argparse.ArgumentTypeError(f"--head {text!r}: expected SEQ:HASH "
                                         "(e.g. 1234:5f0c1e9a2b, at least 6 hex digits)")
    return int(m.group(1)), m.group(2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="clusterpulse-audit", description=__doc__,
                                epilog=EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    v = sub.add_parser("verify", help="check a file's chain", epilog=EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    v.add_argument("file", type=Path)
    v.add_argument("--head", type=_head, help="SEQ:HASH published earlier; the file must "
                   "still hold that record (a prefix of its SHA-256 is enough)")
    a = p.parse_args(argv)
    expect = Head(*a.head) if a.head else None
    try:
        verdict = verify(a.file, expect)
    except OSError as err:
        print(f"clusterpulse-audit: error: {a.file}: {err.strerror or err}", file=sys.stderr)
        return 2
    for line, why in verdict.breaks:
        print(f"{a.file}:{line}: {why}")
    state = "intact" if verdict.intact else f"BROKEN at {len(verdict.breaks)} place(s)"
    print(f"{a.file}: {verdict.records} records, chain {state}; head {verdict.head}")
    return 0 if verdict.intact else 1


if __name__ == "__main__":
    raise SystemExit(main())
