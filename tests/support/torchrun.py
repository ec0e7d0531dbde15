"""Run the reference trainer under a real torchrun (gloo, loopback)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.support.procs import REPO


@dataclass
class RunResult:
    returncode: int
    log: str
    summary: dict | None

    @property
    def digest(self) -> str:
        assert self.summary is not None, f"no summary; log tail:\n{self.log[-3000:]}"
        return self.summary["param_sha256"]


def torchrun_cmd(nproc: int, max_restarts: int, args: list[str],
                 warm: bool = False) -> list[str]:
    """Plain torchrun running the trainer's module; `warm`: the torchrun that
    clusterpulse-train runs (trainer/warmstart/: ranks forked from a server that has
    imported torch and the trainer, once per torchrun, restarts included), without the
    launcher around it or its environment (its relaunch, a store per torchrun). Warm,
    a 2-rank run with one crash restart costs ~12 CPU-s less (four rank imports of
    ~3.5 s against one)."""
    if warm:
        from clusterpulse.trainer.launch import build_command

        return build_command(["--nproc", str(nproc), "--max-restarts", str(max_restarts),
                              "--monitor-interval", "0.2", "--", *args])
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
            "--monitor-interval=0.2", "-m", "clusterpulse.trainer", *args]


def run_trainer(ckpt: Path, nproc: int = 2, steps: int = 40, args: list[str] | None = None,
                max_restarts: int = 0, timeout: float = 240, agent: str = "none",
                extra_env: dict | None = None, warm: bool = False) -> RunResult:
    summary_path = ckpt / "summary.json"
    cmd = torchrun_cmd(nproc, max_restarts, [
        "--preset", "tiny", "--steps", str(steps), "--ckpt-dir", str(ckpt),
        "--summary-json", str(summary_path), "--agent", agent, *(args or [])], warm)
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(extra_env or {})}
    p = subprocess.run(cmd, cwd=ckpt.parent, capture_output=True, text=True, timeout=timeout,
                       env=env)
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    return RunResult(p.returncode, p.stdout + p.stderr, summary)


def start_trainer(ckpt: Path, log: Path, nproc: int = 2, steps: int = 40,
                  args: list[str] | None = None, max_restarts: int = 0,
                  agent: str = "none", warm: bool = False) -> subprocess.Popen:
    cmd = torchrun_cmd(nproc, max_restarts, [
        "--preset", "tiny", "--steps", str(steps), "--ckpt-dir", str(ckpt),
        "--summary-json", str(ckpt / "summary.json"), "--agent", agent, *(args or [])], warm)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    fh = open(log, "wb")  # noqa: SIM115 - owned by the process
    return subprocess.Popen(cmd, cwd=ckpt.parent, stdout=fh, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)





def launcher_cmd(nproc: int, max_restarts: int, args: list[str], nnodes: int | str = 1,
                 rdzv_port: int | None = None, script: str | None = None,
                 cold_start: bool = False, preload: list[str] | None = None,
                 monitor_interval: float = 0.2, rdzv_host: bool | None = None,
                 prewarm_after: float | None = None) -> list[str]:
    """clusterpulse-train (the launcher that relaunches graceful restarts) with the same
    fast worker monitoring as torchrun_cmd; `nnodes` > 1 (or "MIN:MAX"): one such
    command per "node", all on loopback with a c10d rendezvous at `rdzv_port` (every
    one of them is the rendezvous host by torch's guess; `rdzv_host` says which is)."""
    cmd = [sys.executable, "-m", "clusterpulse.trainer.launch", "--nproc", str(nproc),
           "--max-restarts", str(max_restarts), "--monitor-interval", str(monitor_interval)]
    if str(nnodes) != "1":
        cmd += ["--nnodes", str(nnodes), "--rdzv-endpoint", f"127.0.0.1:{rdzv_port}",
                "--rdzv-id", "test"]
    if rdzv_host is not None:
        cmd.append("--rdzv-host" if rdzv_host else "--no-rdzv-host")
    if script:
        cmd += ["--script", script]
    for module in preload or []:
        cmd += ["--preload", module]
    if cold_start:
        cmd.append("--cold-start")
    if prewarm_after is not None:
        cmd += ["--prewarm-after", str(prewarm_after)]
    return [*cmd, "--", *args]


def start_logged(cmd: list[str], log: Path, cwd: Path, extra_env: dict | None = None,
                 ) -> subprocess.Popen:
    """A process group of its own (kill it whole with os.killpg), output in `log`."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **(extra_env or {})}
    fh = open(log, "wb")  # noqa: SIM115 - owned by the process
    return subprocess.Popen(cmd, cwd=cwd, stdout=fh, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def stop_group(p: subprocess.Popen) -> None:
    """End a start_logged process and everything it started: its group, and every
    descendant (torchrun starts ranks in sessions of their own, warm ones in their
    forkserver's)."""
    import contextlib
    import signal

    from deploy.local.stack import descendants

    family = descendants([p.pid])
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGKILL)
    for pid in family:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    p.wait(timeout=30)
