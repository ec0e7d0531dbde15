"""Trainer configuration: the command-line flags (documented in the README)."""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from clusterpulse.agent.protocol import DEFAULT_TELEMETRY, check_run_id
from clusterpulse.agent.validate import is_digits
from clusterpulse.trainer.faults import InjectError, Injection, parse_injection
from clusterpulse.trainer.presets import PRESETS
from clusterpulse.trainer.telemetry import DEFAULT_SOCKET_PATH, AgentAddr, parse_agent_addr

# The launcher's variables the trainer reads as integers, wherever it runs (not
# MASTER_PORT: read only under torchrun, which sets it; without a launcher Kubernetes'
# service links may set it to "tcp://10.96.0.5:29500", unused).
LAUNCHER_INTS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "GROUP_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT")

EXAMPLES = """\
examples:
  torchrun --standalone --nproc-per-node 2 --max-restarts 2 -m clusterpulse.trainer --preset tiny \\
      --steps 60 --ckpt-every 10 --ckpt-dir CKPT --summary-json SUMMARY.json \\
      --inject crash:rank=1:step=35
  torchrun --standalone --nproc-per-node 4 -m clusterpulse.trainer --parallel fsdp --async-ckpt ...
  torchrun --standalone --nproc-per-node 8 -m clusterpulse.trainer --preset 125m --dtype bf16 \\
      --compile --global-batch 64 --steps 500 --summary-json SUMMARY.json   # tokens/s and MFU
  clusterpulse-train --nproc 2 -- --preset tiny --steps 20 --ckpt-dir /tmp/ckpt
"""


class ConfigError(ValueError):
    pass


@dataclass
class TrainConfig:
    preset: str = "tiny"
    steps: int = 100
    global_batch: int = 8
    lr: float = 3e-3
    warmup_steps: int = 10
    seed: int = 1234
    parallel: str = "ddp"
    dtype: str = "fp32"
    compile: bool = False
    ckpt_dir: Path = Path("checkpoints")
    ckpt_every: int = 0
    ckpt_every_seconds: float = 0.0
    keep: int = 3
    async_ckpt: bool = False
    ckpt_lock_wait_s: float = 60.0
    summary_json: Path | None = None
    run_id: str = ""
    agent: AgentAddr | None = DEFAULT_SOCKET_PATH
    consensus_every: int = 5
    sim_compute_seconds: float = 0.0
    sim_sample_seconds: float = 0.0
    collective_timeout_s: float = 600.0
    log_every: int = 10
    injections: list[Injection] = field(default_factory=list)

    def simulated_compute_s(self, samples: int) -> float:
        """The GPU time a step of `samples` sequences stands for on a CPU demo. The
        per-sequence part is what makes an elastic job honest: on one node fewer, each
        rank's share of the fixed global batch grows and so does its step, where a fixed
        pad would let the smaller job step as fast as the whole one."""
        return self.sim_compute_seconds + self.sim_sample_seconds * samples


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m clusterpulse.trainer",
        description="ClusterPulse reference trainer: a decoder-only LM under DDP or FSDP2 "
        "with telemetry, atomic checkpoints, checkpoint-restart and fault injection. "
        "Launch it with torchrun.", epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="model size")
    p.add_argument("--steps", type=int, default=100, help="total training steps")
    p.add_argument("--global-batch", type=int, default=8,
                   help="sequences per step across all ranks (kept on a smaller world size)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--parallel", choices=["ddp", "fsdp"], default="ddp")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                   help="bf16: autocast the forward and the loss to bfloat16 (weights and "
                   "optimizer stay fp32), as GPU runs train (default: fp32)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the model (the first steps are slower while it compiles)")
    p.add_argument("--ckpt-dir", type=Path, default=Path("checkpoints"))
    p.add_argument("--ckpt-every", type=int, default=0, help="checkpoint every N steps (0: off)")
    p.add_argument("--ckpt-every-seconds", type=float, default=0.0,
                   help="also checkpoint when this long has passed since the last one")
    p.add_argument("--keep", type=int, default=3, help="checkpoints to keep (default: 3)")
    p.add_argument("--async-ckpt", action="store_true",
                   help="write checkpoints in the background (dcp.async_save)")
    p.add_argument("--ckpt-lock-wait", type=float, default=60.0,
                   help="seconds to wait for another job to leave --ckpt-dir before "
                   "refusing to start in it (default: 60; a dead node's claim goes "
                   "stale in 45 s)")
    p.add_argument("--summary-json", type=Path, help="rank 0 writes the run summary here")
    p.add_argument("--run-id", default="",
                   help="run label on telemetry (default: the checkpoint directory's name)")
    p.add_argument("--agent", default=os.environ.get("CLUSTERPULSE_AGENT", DEFAULT_TELEMETRY),
                   help="node agent's telemetry socket: unix:/PATH, HOST:PORT (UDP, never "
                   f"trusted to restart) or 'none' (default: $CLUSTERPULSE_AGENT or "
                   f"{DEFAULT_TELEMETRY})")
    p.add_argument("--consensus-every", type=int, default=5,
                   help="steps between restart/straggler exchanges (default: 5)")
    p.add_argument("--sim-compute-seconds", type=float, default=0.0,
                   help="CPU demo with simulated GPUs: pad each step's compute to this long")
    p.add_argument("--sim-sample-seconds", type=float, default=0.0,
                   help="simulated GPU time per sequence of the rank's batch, added to "
                   "--sim-compute-seconds: with the global batch fixed, a smaller world "
                   "gives each rank more sequences and a longer step, as real GPUs take")
    p.add_argument("--collective-timeout", type=float, default=600.0,
                   help="seconds before a stuck collective fails (default: 600)")
    p.add_argument("--log-every", type=int, default=10, help="rank 0 progress line every N steps")
    p.add_argument("--inject", action="append", default=[],
                   help="fault to inject, e.g. crash:rank=1:step=35 (see trainer/faults.py)")
    return p


MAX_SEED = 2**32 - 1


def parse_config(argv: list[str] | None = None, launcher_env: bool = True) -> TrainConfig:
    """The trainer's configuration from its flags; ConfigError naming a bad one. With
    `launcher_env`, also the launcher's variables this process runs under (a rank's:
    torchrun's); without, as clusterpulse-train checks the flags before torchrun
    starts, which sets those for every rank (a scheduler's RANK=node-a is no error)."""
    a = build_parser().parse_args(argv)
    specs = list(a.inject)
    env = os.environ.get("CLUSTERPULSE_INJECT", "")
    specs += [s for s in env.split(",") if s.strip()]
    try:
        injections = [parse_injection(s) for s in specs]
        agent = parse_agent_addr(a.agent)
    except (InjectError, ValueError) as err:
        raise ConfigError(str(err)) from None
    if a.steps < 1 or a.global_batch < 1 or a.consensus_every < 1 or a.keep < 1:
        raise ConfigError("--steps, --global-batch, --consensus-every and --keep must be >= 1")
    run_id = a.run_id or a.ckpt_dir.resolve().name
    try:
        check_run_id(run_id)
    except ValueError as err:
        raise ConfigError(f"{err} (set --run-id)") from None
    if a.ckpt_every < 0 or a.ckpt_every_seconds < 0:
        raise ConfigError("--ckpt-every and --ckpt-every-seconds must be >= 0")
    if a.sim_compute_seconds < 0 or a.sim_sample_seconds < 0:
        raise ConfigError("--sim-compute-seconds and --sim-sample-seconds must be >= 0")
    if not (math.isfinite(a.collective_timeout) and a.collective_timeout > 0):
        raise ConfigError(f"--collective-timeout must be a number of seconds > 0, got "
                          f"{a.collective_timeout}")
    if not (math.isfinite(a.ckpt_lock_wait) and a.ckpt_lock_wait >= 0):
        raise ConfigError(f"--ckpt-lock-wait must be a number of seconds >= 0, got "
                          f"{a.ckpt_lock_wait}")
    if not math.isfinite(a.lr):
        raise ConfigError(f"--lr must be a number, got {a.lr}")
    if not 0 <= a.seed <= MAX_SEED:  # each step's batch is drawn from seed x 1,000,003 +
        # step, a 64-bit seed: a nanosecond timestamp overflowed it on every rank
        raise ConfigError(f"--seed must be 0..{MAX_SEED}, got {a.seed}")
    if a.ckpt_dir.exists() and not a.ckpt_dir.is_dir():
        raise ConfigError(f"--ckpt-dir {a.ckpt_dir} exists and is not a directory")
    for name in LAUNCHER_INTS if launcher_env else ():  # torchrun's; by hand a typo crashed
        value = os.environ.get(name, "")
        if value and not is_digits(value):
            raise ConfigError(f"${name} must be a whole number >= 0, got {value!r}")
    return TrainConfig(
        preset=a.preset, steps=a.steps, global_batch=a.global_batch, lr=a.lr,
        warmup_steps=a.warmup_steps, seed=a.seed, parallel=a.parallel, dtype=a.dtype,
        compile=a.compile,
        ckpt_dir=a.ckpt_dir.resolve(), ckpt_every=a.ckpt_every,
        ckpt_every_seconds=a.ckpt_every_seconds, keep=a.keep, async_ckpt=a.async_ckpt,
        ckpt_lock_wait_s=a.ckpt_lock_wait, summary_json=a.summary_json, run_id=run_id,
        agent=agent, consensus_every=a.consensus_every,
        sim_compute_seconds=a.sim_compute_seconds, sim_sample_seconds=a.sim_sample_seconds,
        collective_timeout_s=a.collective_timeout,
        log_every=a.log_every, injections=injections,
    )
