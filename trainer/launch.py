"""`clusterpulse-train`: torchrun with sensible defaults for the reference trainer.

Everything after `--` goes to the trainer (`python -m trainer --help`).
"""

from __future__ import annotations

import argparse
import os
import sys

EXAMPLES = """\
examples:
  clusterpulse-train --nproc 2 -- --preset tiny --steps 60 --ckpt-every 10 --ckpt-dir /tmp/ckpt
  clusterpulse-train --nproc 8 --max-restarts 3 -- --preset 1b --parallel fsdp --async-ckpt \\
      --ckpt-dir /shared/ckpt/run1 --ckpt-every 500
  # two nodes: run on each, with the same rendezvous endpoint
  clusterpulse-train --nnodes 2 --rdzv-endpoint head:29400 --nproc 8 -- --ckpt-dir /shared/ckpt
"""


def build_command(argv: list[str]) -> list[str]:
    if "--" in argv:
        i = argv.index("--")
        ours, trainer_args = argv[:i], argv[i + 1:]
    else:
        ours, trainer_args = argv, []
    p = argparse.ArgumentParser(prog="clusterpulse-train", description=__doc__, epilog=EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=None,
                   help="ranks on this node (default: GPUs, or 2 on CPU)")
    p.add_argument("--nnodes", default="1", help="nodes, or MIN:MAX (default: 1)")
    p.add_argument("--max-restarts", type=int, default=3,
                   help="restarts torchrun allows the worker group (default: 3)")
    p.add_argument("--rdzv-endpoint", default="",
                   help="HOST:PORT of the c10d rendezvous for multi-node runs")
    p.add_argument("--rdzv-id", default="clusterpulse", help="rendezvous id")
    a = p.parse_args(ours)
    nproc = a.nproc
    if nproc is None:
        import torch

        nproc = torch.cuda.device_count() or 2
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--max-restarts={a.max_restarts}"]
    if a.rdzv_endpoint:
        cmd += [f"--nnodes={a.nnodes}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={a.rdzv_endpoint}", f"--rdzv-id={a.rdzv_id}"]
    else:
        cmd += ["--standalone"]
    return [*cmd, "-m", "trainer", *trainer_args]


def main(argv: list[str] | None = None) -> int:
    cmd = build_command(sys.argv[1:] if argv is None else argv)
    os.execv(cmd[0], cmd)
    return 0  # not reached
