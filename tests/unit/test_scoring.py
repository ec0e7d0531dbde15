"""Straggler scoring against peers and own history (detection.scoring): what real
clusters do must not flag; a rank that becomes 1.2x slower must."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from clusterpulse.detection.scoring import ScoringConfig, StragglerScorer

RANKS, STEPS = 64, 400


def noisy(seed: int, rho: float = 0.5, sd: float = 0.05) -> np.ndarray:
    """AR(1) jitter (each rank's noise correlated step to step) around 0.1 s."""
    rng = np.random.default_rng(seed)
    e = np.zeros((STEPS, RANKS))
    e[0] = rng.normal(0, sd, RANKS)
    for t in range(1, STEPS):
        e[t] = rho * e[t - 1] + rng.normal(0, sd * np.sqrt(1 - rho * rho), RANKS)
    return 0.1 * np.exp(e)


def flags(x: np.ndarray, groups=None) -> dict[int, int]:
    scorer = StragglerScorer(x.shape[1], groups=groups)
    out: dict[int, int] = {}
    for t in range(0, len(x), 5):
        s = scorer.observe(x[t:t + 5])
        if s is not None:
            for r in np.nonzero(s.flagged)[0]:
                out.setdefault(int(r), s.step)
    return out


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_spread_ar1_noise_stages_rank0_and_job_wide_pauses_do_not_flag(seed):
    x = noisy(seed)
    x *= np.random.default_rng(seed).uniform(1.0, 1.03, RANKS)  # persistent 0-3 % spread
    x[:, 1] *= 1.03  # a GPU 3 % slower for life
    x *= np.repeat([1.0, 1.2, 0.9, 1.1], RANKS // 4)  # pipeline stages of unequal cost
    x[:, 0] *= 1.15  # rank 0's extra work
    x[np.arange(STEPS) % 100 == 99] *= 4.0  # job-wide checkpoint pauses
    x[150:200] *= 1.5  # a job-wide slowdown
    assert flags(x) == {}


def test_a_rank_that_becomes_1_2x_slower_is_flagged_within_a_few_windows():
    x = noisy(4)
    x[:, 7] *= 1.03  # it was already a slightly slower GPU
    x[300:, 7] *= 1.2
    got = flags(x)
    assert list(got) == [7] and 300 < got[7] <= 325


def test_a_rank_much_slower_than_its_peers_from_the_start_is_flagged():
    """Self-history cannot excuse a GPU 1.8x slower than its siblings since step 1."""
    x = noisy(6)
    x[:, 5] *= 1.8
    got = flags(x)
    assert list(got) == [5] and got[5] <= ScoringConfig().warmup_steps + 5


def test_peer_groups_compare_like_with_like():
    """Stage 1 is 30 % slower by design; its slowest member becoming 1.2x slower is
    flagged against its stage, and nothing else is."""
    x = noisy(5)
    groups = np.repeat([0, 1], RANKS // 2)
    x[:, RANKS // 2:] *= 1.3
    x[250:, RANKS - 1] *= 1.2
    assert list(flags(x, groups=groups)) == [RANKS - 1]


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="expected 4 ranks"):
        StragglerScorer(4).observe([[1.0, 1.0]])
    with pytest.raises(ValueError, match="self_threshold"):
        StragglerScorer(4, config=ScoringConfig(self_threshold=0.9))


def test_scoring_module_does_not_import_torch():
    code = "import sys, detection.scoring; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "False"
