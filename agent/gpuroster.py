"""The node's GPUs, remembered across agent restarts.

NVML enumerates only the GPUs the driver sees now: one that fell off the bus before an
agent restart is simply not there, and the next GPU takes its index. An agent that
trusted the enumeration after a restart would list one GPU fewer, all up, and relabel
the next one, so `clusterpulse_gpu_up` for the dead GPU vanishes instead of reading 0,
GpuDown resolves and the health check puts the node back into service. The roster
keeps, per GPU UUID, the `gpu` label the agent first exported for it (with its PCI
address and name, for the operator and for a card replaced in the same slot) in
`gpus.json` under `--state-dir`, written atomically whenever it changes. A GPU in the
roster that NVML does not list is reported down (`missing`) until it comes back, or
until an operator removes it from the file (docs/agent.md, "A GPU that is gone").

Kept only with `--remember-gpus`, which the node-level deploy files pass: the roster is
the whole node's, so an agent that sees only some GPUs (a Slurm job step under
ConstrainDevices, a container given a subset) would report all the others missing.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from clusterpulse.agent.xidstate import write_json_atomic

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KnownGpu:
    uuid: str
    index: int  # the exported `gpu` label
    pci_bus_id: str = ""
    name: str = ""


class GpuRoster:
    """Reads and writes `path`: {uuid: {"gpu": N, "pci_bus_id": ..., "name": ...}}."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> list[KnownGpu]:
        """The remembered GPUs by label; an unreadable file is logged and read as empty
        (the agent then starts from NVML's enumeration, as without --state-dir)."""
        try:
            raw = json.loads(self.path.read_text())
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as err:
            log.warning("GPU roster %s unreadable (%s): starting from NVML's enumeration",
                        self.path, err)
            return []
        if not isinstance(raw, dict):
            log.warning("GPU roster %s is not a JSON object: ignored", self.path)
            return []
        known: list[KnownGpu] = []
        labels: set[int] = set()
        for uuid, entry in raw.items():
            index = entry.get("gpu") if isinstance(entry, dict) else None
            if not isinstance(index, int) or isinstance(index, bool) or index < 0 \
                    or index in labels:
                log.warning("GPU roster %s: entry %r has no free gpu label: ignored",
                            self.path, uuid)
                continue
            labels.add(index)
            known.append(KnownGpu(uuid=uuid, index=index,
                                  pci_bus_id=str(entry.get("pci_bus_id", "")),
                                  name=str(entry.get("name", ""))))
        return sorted(known, key=lambda g: g.index)

    def save(self, gpus: list[KnownGpu]) -> None:
        write_json_atomic(self.path, {g.uuid: {"gpu": g.index, "pci_bus_id": g.pci_bus_id,
                                               "name": g.name} for g in gpus}, "GPU roster")
