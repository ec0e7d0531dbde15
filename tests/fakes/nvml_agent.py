"""The real agent process (`clusterpulse-agent --backend nvml`) over the fake NVML, for
tests that need a node whose GPU counters start where the test says: a node first seen
with NVLink errors behind it (tests/integration/test_sharded_scrape.py).

    python -m tests.fakes.nvml_agent [AGENT ARGS...] --nvlink-errors N

--nvlink-errors N: GPU 0's NVLink 0 has counted N replay errors before the agent starts
(flat from then on). Every other argument goes to the agent unchanged.
"""

from __future__ import annotations

import sys

import pynvml

from clusterpulse.agent import cli
from tests.fakes.fake_pynvml import FakeNvml


def main(argv: list[str]) -> int:
    errors = 0
    if "--nvlink-errors" in argv:
        i = argv.index("--nvlink-errors")
        if i + 1 == len(argv) or not argv[i + 1].isdigit():
            print("nvml_agent: --nvlink-errors needs a whole number", file=sys.stderr)
            return 2
        errors, argv = int(argv[i + 1]), argv[:i] + argv[i + 2:]
    fake = FakeNvml(gpus=2)
    fake.gpus[0].nvlink_errors[(0, pynvml.NVML_NVLINK_ERROR_DL_REPLAY)] = errors
    # The backend imports "pynvml" when it starts: it gets the fake.
    sys.modules["pynvml"] = fake  # type: ignore[assignment]
    return cli.main([*argv, "--backend", "nvml"])  # last: over a --backend sim before


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
