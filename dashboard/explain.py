"""What a down GPU's reason and an XID code mean, in words an on-call engineer can act on.

The Node page showed a lost GPU as `gpu_is_lost` and "XID 79" with no explanation,
and its link row as `Gennan xnan`, health "ok": the reader had to know NVML's error
names and NVIDIA's XID catalogue. One table each, used by every page that names them.
"""

from __future__ import annotations

# clusterpulse_gpu_down_reason{reason=...}: NVML's error kind (agent/backends/nvml.py)
DOWN_REASONS = {
    "gpu_is_lost": "fell off the bus (NVML GPU_IS_LOST): the driver lost it and its ranks "
                   "cannot run; drain the node, then reset the GPU or reboot, else replace it",
    "missing": "not found when NVML last enumerated the GPUs (removed, or hidden from the "
               "driver); check the node's PCIe devices",
    "reset_required": "needs a GPU reset (nvidia-smi -r) before it can be used again",
    "uninitialized": "NVML lost its state for it (the driver was reloaded); the agent "
                     "re-initializes NVML",
    "unknown": "does not answer NVML, for a reason the agent cannot tell; see its log",
}
# NVIDIA's XID catalogue, the codes the rules and health checks care about
XIDS = {
    13: "graphics engine exception (usually the application)",
    31: "GPU memory page fault (usually the application)",
    43: "GPU stopped processing (usually the application)",
    48: "double-bit ECC error: drain and reset the GPU",
    63: "row remapping event (ECC): reset the GPU to apply it",
    64: "row remapping failure: replace the GPU",
    74: "NVLink error",
    79: "GPU has fallen off the bus: drain the node, reset or replace the GPU",
    92: "high single-bit ECC error rate",
    94: "contained ECC error: reset the GPU",
    95: "uncontained ECC error: drain and reset the GPU",
    119: "GSP RPC timeout: reset the GPU",
    120: "GSP error: reset the GPU",
    140: "unrecovered ECC error: drain and reset the GPU",
}


def down_reason(reason: str) -> str:
    """'gpu_is_lost' -> 'gpu_is_lost: fell off the bus (...)'."""
    return f"{reason}: {DOWN_REASONS.get(reason, DOWN_REASONS['unknown'])}"


def xid(code: object) -> str:
    try:
        return XIDS.get(int(str(code)), "see NVIDIA's XID catalogue")
    except ValueError:
        return "not an XID code"


def failing_readings(gpu: str, share: float, readings: list[str], now: list[str]) -> str:
    """What the Node page says of a GPU up whose NVML readings fail (GpuReadingsFailing's
    evidence, dashboard/data.py FailingReadings): present tense while the latest cycle
    failed too, past once it read them all."""
    window = (f"in {share:.0%} of the agent's cycles of the last 10 minutes "
              f"({', '.join(readings)})")
    if now:
        return (f"GPU {gpu}: NVML fails its readings {window}, and in the latest cycle "
                f"({', '.join(now)}). Those charts have gaps for it and the alerts that "
                "read them cannot fire for it (GpuReadingsFailing fires at half the cycles "
                "for 5 minutes).")
    return (f"GPU {gpu}: NVML failed its readings {window}, none in the latest cycle. "
            "Those charts have gaps for it in that time.")
