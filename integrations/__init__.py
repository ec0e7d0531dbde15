"""ClusterPulse for loops a framework drives: `lightning` (a Lightning Callback) and
`hf` (a transformers TrainerCallback). Each needs its framework (the extras
`clusterpulse[lightning]`, `clusterpulse[hf]`); `data` has what both and the plain
recipe use to resume mid-epoch without reading the skipped batches again."""
