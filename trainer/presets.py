"""The reference model's sizes, apart from the model: the launcher checks the
trainer's flags (`--preset` among them) before torchrun starts any rank, and must not
import torch for it (~1 s of CPU in every launcher)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    vocab: int
    dim: int
    layers: int
    heads: int
    seq_len: int


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(vocab=256, dim=64, layers=2, heads=4, seq_len=32),  # CPU tests
    "small": ModelConfig(vocab=4096, dim=256, layers=4, heads=8, seq_len=128),  # CPU demo
    "125m": ModelConfig(vocab=32000, dim=768, layers=12, heads=12, seq_len=1024),
    "350m": ModelConfig(vocab=32000, dim=1024, layers=24, heads=16, seq_len=1024),
    "1b": ModelConfig(vocab=32000, dim=2048, layers=16, heads=16, seq_len=2048),
}
