"""The torch versions the trainer and the instrumentation run on, and what older ones lack.

Clusters run the torch of their container images, not the newest: the supported range
starts at `OLDEST` (torch 2.6, the release of the NGC 25.01 PyTorch image and of the
stock images of that season), and CI runs the trainer and instrumentation tests on it
as well as on the newest (scripts/test-oldest-torch.sh). Below it the trainer and
`Pulse` refuse to start with one line naming the versions, instead of failing mid-run.

Features newer than `OLDEST` are looked up where they are used, never assumed from
a version number, and each absence is said once in the log (`fallback`), with what
runs instead: stock torch behaviour, at most slower. Today:
- `DefaultSavePlanner(enable_plan_caching=...)` (torch 2.7): without it every save
  plans afresh (a few ms of host time per checkpoint).
- `torch.distributed.checkpoint.staging.DefaultStager` (torch 2.9): without it
  `dcp.async_save` stages each checkpoint to host memory itself, into new buffers.
- torchrun's rendezvous keep-alive from `--rdzv-conf` (torch 2.7): without it torch's
  own 5 s heartbeat, so a lost node leaves a multi-node rendezvous after 15 s, not 5 s.
Absent and not replaceable: FSDP2 on CPU before torch 2.7 (`fsdp_on_cpu`; on GPUs it
runs): the reference trainer refuses `--parallel fsdp` on CPU there, naming both.
The rendezvous and log-formatter changes of trainer/torchrun.py and trainer/spares.py
check the private attributes they change in the same way, and so does
`Pulse.attach_ddp` with the DDP internals it reads (`ddp_output_tensors`,
`ddp_rebuild_flag`: the same in torch 2.6 to 2.13).
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import logging
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import fields, is_dataclass
from typing import Any

log = logging.getLogger("clusterpulse.trainer.torch_support")

OLDEST = (2, 6)  # pyproject's torch>= and the CI's second venv say the same (a test)


class UnsupportedTorch(RuntimeError):
    """This torch is older than the oldest the trainer supports."""


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string: "2.6.0a0+ecf3bae.nv25.01", an NGC
    image's build of 2.6, is 2.6 (by PEP 440 a pre-release, older than 2.6.0)."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None:
        raise UnsupportedTorch(f"cannot read the torch version {version!r}")
    return int(found[1]), int(found[2])


def installed() -> str:
    """The torch version, without importing torch where it is not imported yet (the
    launcher checks before its ranks start, and never needs torch itself)."""
    torch = sys.modules.get("torch")
    return str(torch.__version__) if torch is not None else importlib.metadata.version("torch")


def require_supported(version: str | None = None) -> None:
    """Raise UnsupportedTorch, naming both versions, below `OLDEST`."""
    version = version or installed()
    if release(version) < OLDEST:
        oldest = ".".join(map(str, OLDEST))
        raise UnsupportedTorch(
            f"ClusterPulse's trainer needs torch >= {oldest}; this is torch {version}: "
            f"pip install 'torch>={oldest}' (or use the image of a newer release)")


@functools.cache
def fallback(feature: str, instead: str) -> None:
    """Say once per process that this torch lacks `feature` and what runs instead."""
    log.info("torch %s has no %s: %s", installed(), feature, instead)


def save_planner() -> Any:
    """DCP's default planner, caching its save plan where torch can (the plan is the
    same every save: a model's structure does not change)."""
    import torch.distributed.checkpoint as dcp

    if "enable_plan_caching" in inspect.signature(dcp.DefaultSavePlanner).parameters:
        return dcp.DefaultSavePlanner(enable_plan_caching=True)
    fallback("save plan caching (DefaultSavePlanner(enable_plan_caching), torch 2.7)",
             "each checkpoint is planned afresh")
    return dcp.DefaultSavePlanner()


def rendezvous_keep_alive() -> bool:
    """Whether torchrun takes the rendezvous keep-alive from --rdzv-conf (torch 2.7);
    an older one keeps its own (a heartbeat every 5 s, a node lost after 3 missed)."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
    )

    if "keep_alive_interval" in inspect.signature(DynamicRendezvousHandler.from_backend).parameters:
        return True
    fallback("rendezvous keep-alive settings (torch 2.7)",
             "torchrun keeps its own 5 s heartbeat: a lost node leaves the rendezvous "
             "after 15 s instead of 5 s")
    return False


def fsdp_on_cpu() -> bool:
    """Whether FSDP2 (`fully_shard`) runs on CPU tensors: torch 2.6's all-gather records
    an event on the CPU "stream", which has no events before 2.7 (on GPUs it runs)."""
    import torch

    return hasattr(torch.cpu.Stream, "record_event")


def stager_api() -> tuple[Any, Any] | None:
    """torch's (DefaultStager, StagingOptions), or None where this torch has none."""
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError:
        fallback("DefaultStager (torch 2.9)",
                 "dcp.async_save stages each async checkpoint into new host buffers")
        return None
    return DefaultStager, StagingOptions


def _output_tensors(obj: Any) -> Iterable[Any]:
    """The tensors in a forward's output, walked as DDP walks it (below)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, list | tuple):
        return [t for item in obj for t in _output_tensors(item)]
    if isinstance(obj, dict):
        return [t for item in obj.values() for t in _output_tensors(item)]
    if is_dataclass(obj) and not isinstance(obj, type):
        return [t for f in fields(obj) for t in _output_tensors(getattr(obj, f.name))]
    return []


def ddp_output_tensors() -> Callable[[Any], list[Any]]:
    """The tensors of a forward's output as DDP finds them, each once. DDP looks twice:
    with pytree's flatten (its _DDPSink; a class registered with pytree, which
    `_find_tensors` does not open) and with `_find_tensors` (private: lists, tuples,
    dicts and dataclasses, nested; an RRef this rank owns), which pytree does not open
    for a dataclass (a dataclass output's backward went unmarked). Where a torch lacks
    `_find_tensors`, the same walk of ours, without RRefs."""
    import torch
    from torch.utils._pytree import tree_leaves

    try:
        from torch.nn.parallel.distributed import _find_tensors as find
    except ImportError:
        fallback("DDP's _find_tensors", "the instrumentation walks a forward's output "
                 "itself (lists, tuples, dicts, dataclasses; not RRefs)")
        find = _output_tensors

    def tensors(output: Any) -> list[Any]:
        seen: set[int] = set()
        out = []
        for t in (*tree_leaves(output), *find(output)):
            if isinstance(t, torch.Tensor) and id(t) not in seen:
                seen.add(id(t))
                out.append(t)
        return out

    return tensors


def ddp_rebuild_flag(ddp_model: Any) -> bool:
    """Whether this torch's DDP says when it has rebuilt its buckets: its pre-forward
    sets `_has_rebuilt_buckets` (private) in the forward that rebuilt them (the first
    with gradients after the first backward it reduced, with static_graph after the
    second), a collective that waits for every peer. Without it that wait counts as
    compute. False too where the pre-forward never rebuilds: DDP's Python reducer
    (compiled autograd) or all-reduces delayed for every parameter (it returns first)."""
    if isinstance(getattr(ddp_model, "_has_rebuilt_buckets", None), bool):
        return not (getattr(ddp_model, "_use_python_reducer", False)
                    or getattr(ddp_model, "_delay_all_reduce_all_params", False))
    fallback("DDP's _has_rebuilt_buckets",
             "the wait for peers in DDP's bucket rebuild (one forward) counts as compute")
    return False
