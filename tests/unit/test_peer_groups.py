"""Peer groups through the trainer's real exchange: pipeline stages differ by design, so
ranks of one stage are scored against each other (Pulse(peer_group=...)). A review
found every rank of the costliest stage flagged from step 1 when all ranks were one
group (the 1.3x gross rule), and no way to say otherwise outside offline replay."""

from __future__ import annotations

import json
from pathlib import Path

from clusterpulse.trainer.consensus import peer_groups
from tests.support.worlds import run_ranks

STAGE_COST = [1.0, 1.0, 1.4, 1.4]  # two pipeline stages, two data-parallel ranks each
STEPS = 300


def test_labels_make_groups_only_where_each_has_two_ranks():
    assert peer_groups(["", "", "", ""]) is None
    assert peer_groups(["s0", "s0", "s1", "s1"]) == [0, 0, 1, 1]
    assert peer_groups(["s1", "s0", "s1", "s0"]) == [1, 0, 1, 0]
    assert peer_groups(["s0", "s1", "s2", "s3"]) is None  # a pipeline without data parallelism
    assert peer_groups(["s0", "s0", "s1"]) is None  # a rank alone: nothing to compare it to
    assert peer_groups(["only"]) is None


CASES = {"one": (False, -1), "healthy": (True, -1), "slow": (True, 3)}  # grouped, slow rank

# Each case in turn on one process group (a process start costs seconds).
WORKER = """
import json, os, sys
from pathlib import Path
import numpy as np
import torch.distributed as dist
from clusterpulse.trainer.consensus import Consensus
from tests.unit.test_peer_groups import CASES, STAGE_COST, STEPS
rank, world, store, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
seen = {}
for name, (grouped, slow) in CASES.items():
    c = Consensus(every=5, peer_group=f"stage{rank // 2}" if grouped else "")
    rng = np.random.default_rng(rank)
    flagged = set()
    for step in range(1, STEPS + 1):
        late = slow == rank and step > 150  # a straggler inside the costly stage
        c.record(STAGE_COST[rank] * rng.gamma(400, 1 / 400) * (1.2 if late else 1.0))
        if c.due(step):
            c.exchange(False, world)
            if c.last is not None:
                flagged |= {int(r) for r in np.nonzero(c.last.flagged)[0]}
    seen[name] = sorted(flagged)
Path(f"{out}.{rank}").write_text(json.dumps(seen))
os._exit(0)  # gloo not torn down: tests/support/worlds.run_ranks
"""


def test_a_costlier_stage_is_no_straggler_and_its_straggler_is_found(tmp_path):
    out = str(tmp_path / "flagged")
    run_ranks(WORKER, 4, tmp_path, out)
    seen = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(4)]
    # one group: the costlier stage's ranks are "stragglers" for the whole run
    assert [s["one"] for s in seen] == [[2, 3]] * 4
    # a group per stage: no one, and then the rank that turns 1.2x slower in the
    # costlier stage alone, the same decision on every rank
    assert [s["healthy"] for s in seen] == [[]] * 4
    assert [s["slow"] for s in seen] == [[3]] * 4
