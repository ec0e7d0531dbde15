"""Model FLOPs utilisation (MFU): the share of the GPU's peak arithmetic a run turns
into training. One home for the FLOPs count and the peaks, so the trainer's summary
and tests/bench/bench_gpu.py report the same figure."""

from __future__ import annotations

from clusterpulse.trainer.model import ModelConfig

# Dense bf16 peak per GPU by the vendor's datasheet (SXM parts), matched on the name
# torch reports. MFU is quoted against bf16 (what --dtype bf16 trains in).
PEAK_BF16 = {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12, "L40S": 362e12}


def flops_per_token(c: ModelConfig) -> float:
    """Training FLOPs per token (forward and backward) by the PaLM paper's count, which
    MFU figures are usually quoted with: 6 per weight of every matrix product (the
    blocks' 12 d^2 and the output head's d x vocab; the embedding is a lookup), plus
    12 L d T for attention's scores and weighted sum over the whole sequence (causal
    masking is not subtracted)."""
    matmul_weights = c.layers * 12 * c.dim * c.dim + c.dim * c.vocab
    return 6.0 * matmul_weights + 12.0 * c.layers * c.dim * c.seq_len


def peak_bf16(device_name: str) -> float | None:
    """The GPU's dense bf16 peak in FLOP/s; None for one not in the table (or a CPU)."""
    return next((v for k, v in PEAK_BF16.items() if k in device_name), None)


def mfu(tokens_per_second: float, c: ModelConfig, gpus: int, device_name: str
        ) -> float | None:
    """Model FLOPs utilisation across `gpus` GPUs, or None where the peak is unknown."""
    peak = peak_bf16(device_name)
    if peak is None or gpus < 1:
        return None
    return tokens_per_second * flops_per_token(c) / (peak * gpus)
