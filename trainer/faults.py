"""Fault injection for tests and demos: `--inject KIND:key=value:...` (repeatable) or
the CLUSTERPULSE_INJECT environment variable (specs separated by commas).

    slow:rank=1:step=10:factor=1.5     rank 1 computes 1.5x slower from step 10 on
    hang:rank=1:step=40                rank 1 stops making progress (process alive)
    crash:rank=1:step=35[:mode=exception|exit|sigkill]
    data_slow:rank=0:step=5:seconds=0.2   rank 0 waits for data each step from step 5
    ckpt_fail:step=20                  the checkpoint write at step 20 fails
    ckpt_slow:step=20:seconds=15       the checkpoint at step 20 blocks training 15 s longer
                                       (slow shared storage)
    ckpt_corrupt:step=20               the published checkpoint of step 20 is corrupted
    ckpt_unloadable:step=20            the published checkpoint of step 20 verifies but
                                       does not load (a torn write certified by its manifest)
    ckpt_kill:step=20[:rank=0]         the rank is SIGKILLed during the checkpoint write
    ckpt_hang:rank=1:step=40           rank 1 blocks (alive, forever) in the checkpoint save
                                       of step 40 before DCP's first collective, where the
                                       other ranks wait for it (a write stuck on storage)
    graceful:step=12[:rank=0]          as if the agent delivered a checkpoint-restart command
                                       to the rank after step 12 (default rank 0)
    init_crash:rank=1                  the rank exits (code 1) before joining the process
                                       group, like a CUDA error at set_device or a bad import
    init_hang:rank=1                   the rank never joins the process group (alive), like
                                       a rank stuck in NCCL or CUDA initialisation

A fault fires only in the attempt it names (`attempt`, default 0: the first run), so
a crash at step 35 does not recur after torchrun restarts the job from step 30.
The attempt is the number all ranks agree on (trainer.parallel); `init_crash` and
`init_hang` fire before any agreement exists, so it counts this node's own starts instead
(`trainer.parallel.local_attempt`).
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = {"slow", "hang", "crash", "data_slow", "ckpt_fail", "ckpt_slow", "ckpt_corrupt",
         "ckpt_kill", "graceful", "init_crash", "init_hang", "ckpt_unloadable", "ckpt_hang"}
RANK_REQUIRED = {"ckpt_hang"}  # on every rank it would be a slow store, not a hang
CRASH_MODES = {"exception", "exit", "sigkill"}


class InjectError(ValueError):
    pass


@dataclass(frozen=True)
class Injection:
    kind: str
    step: int
    rank: int | None = None  # None: every rank (checkpoint faults: rank 0 decides)
    factor: float = 1.5
    seconds: float = 0.1
    mode: str = "exception"
    attempt: int = 0

    def applies(self, rank: int, attempt: int) -> bool:
        return attempt == self.attempt and (self.rank is None or self.rank == rank)


def parse_injection(spec: str) -> Injection:
    kind, *pairs = spec.strip().split(":")
    if kind not in KINDS:
        raise InjectError(f"--inject {spec!r}: unknown kind {kind!r}; known: "
                          f"{', '.join(sorted(KINDS))}")
    fields: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise InjectError(f"--inject {spec!r}: {pair!r} is not key=value")
        fields[key] = value
    unknown = set(fields) - {"rank", "step", "factor", "seconds", "mode", "attempt"}
    if unknown:
        raise InjectError(f"--inject {spec!r}: unknown keys {', '.join(sorted(unknown))}")
    try:
        inj = Injection(
            kind=kind, step=int(fields.get("step", "1")),
            rank=int(fields["rank"]) if "rank" in fields else None,
            factor=float(fields.get("factor", 1.5)), seconds=float(fields.get("seconds", 0.1)),
            mode=fields.get("mode", "exception"), attempt=int(fields.get("attempt", "0")),
        )
    except ValueError as err:
        raise InjectError(f"--inject {spec!r}: {err}") from None
    if inj.mode not in CRASH_MODES:
        raise InjectError(f"--inject {spec!r}: mode must be one of {sorted(CRASH_MODES)}")
    if inj.kind in RANK_REQUIRED and inj.rank is None:
        raise InjectError(f"--inject {spec!r}: {inj.kind} needs rank=N (the rank that blocks)")
    if inj.factor < 1.0 or inj.seconds < 0 or inj.step < 1:
        raise InjectError(f"--inject {spec!r}: need factor >= 1, seconds >= 0, step >= 1")
    return inj


class Faults:
    """The injections that concern this rank in this attempt."""

    def __init__(self, injections: list[Injection], rank: int, attempt: int) -> None:
        self.mine = [i for i in injections if i.applies(rank, attempt)]
        self.rank = rank

    def _at(self, kind: str, step: int) -> Injection | None:
        return next((i for i in self.mine if i.kind == kind and i.step == step), None)

    def slow_factor(self, step: int) -> float:
        f = 1.0
        for i in self.mine:
            if i.kind == "slow" and step >= i.step:
                f *= i.factor
        return f

    def data_delay(self, step: int) -> float:
        return sum(i.seconds for i in self.mine if i.kind == "data_slow" and step >= i.step)

    def hang_at(self, step: int) -> bool:
        return self._at("hang", step) is not None

    def crash_at(self, step: int) -> str | None:
        i = self._at("crash", step)
        return i.mode if i else None

    def ckpt_fail(self, step: int) -> bool:
        return self._at("ckpt_fail", step) is not None

    def ckpt_delay(self, step: int) -> float:
        i = self._at("ckpt_slow", step)
        return i.seconds if i else 0.0

    def ckpt_corrupt(self, step: int) -> bool:
        return self._at("ckpt_corrupt", step) is not None

    def graceful_at(self, step: int) -> bool:
        i = self._at("graceful", step)
        return i is not None and (i.rank is not None or self.rank == 0)

    def ckpt_unloadable(self, step: int) -> bool:
        return self._at("ckpt_unloadable", step) is not None

    def init_crash(self) -> bool:
        return any(i.kind == "init_crash" for i in self.mine)

    def init_hang(self) -> bool:
        return any(i.kind == "init_hang" for i in self.mine)

    def ckpt_hang(self, step: int) -> bool:
        return self._at("ckpt_hang", step) is not None

    def ckpt_kill(self, step: int) -> bool:
        i = self._at("ckpt_kill", step)
        return i is not None and (i.rank is not None or self.rank == 0)
