"""The real agent process (`clusterpulse-agent --backend nvml`) over the fake NVML, for
tests that need a node whose GPU counters start where the test says: a node first seen
with NVLink errors behind it (tests/integration/test_sharded_scrape.py).

    python -m tests.fakes.nvml_agent [AGENT ARGS...] [--nvlink-errors N] [--fake-gpus N]
                                     [--lost-gpu I] [--failing-call NAME]

--nvlink-errors N: GPU 0's NVLink 0 has counted N replay errors before the agent starts
(flat from then on). --fake-gpus N: the node has N GPUs (default 2). --lost-gpu I: GPU I
(UUID GPU-fake-I) is off the bus before the agent starts, so NVML does not list it
(tests/integration/test_healthcheck.py). --failing-call NAME: GPU 0 answers the pynvml
call NAME (e.g. nvmlDeviceGetTemperature) with NVML_ERROR_UNKNOWN, every cycle, while
it stays up (tests/integration/test_dashboard_pages.py). Every other argument goes to
the agent unchanged.
"""

from __future__ import annotations

import sys

import pynvml

from clusterpulse.agent import cli
from tests.fakes.fake_pynvml import FakeNvml


def _take(argv: list[str], flag: str, digits: bool = True) -> tuple[str | None, list[str]]:
    """The value after `flag` (None if absent; a whole number unless not `digits`) and
    argv without the two."""
    if flag not in argv:
        return None, argv
    i = argv.index(flag)
    if i + 1 == len(argv) or (digits and not argv[i + 1].isdigit()):
        raise ValueError(f"nvml_agent: {flag} needs "
                         f"{'a whole number' if digits else 'a value'}")
    return argv[i + 1], argv[:i] + argv[i + 2:]


def main(argv: list[str]) -> int:
    try:
        errors, argv = _take(argv, "--nvlink-errors")
        gpus, argv = _take(argv, "--fake-gpus")
        lost, argv = _take(argv, "--lost-gpu")
        failing, argv = _take(argv, "--failing-call", digits=False)
    except ValueError as err:
        print(err, file=sys.stderr)
        return 2
    fake = FakeNvml(gpus=2 if gpus is None else int(gpus))
    fake.gpus[0].nvlink_errors[(0, pynvml.NVML_NVLINK_ERROR_DL_REPLAY)] = int(errors or 0)
    if lost is not None:
        fake.gpus[int(lost)].lost = True
    if failing is not None:
        fake.gpus[0].failing_fns.add(failing)
    # The backend imports "pynvml" when it starts: it gets the fake.
    sys.modules["pynvml"] = fake  # type: ignore[assignment]
    return cli.main([*argv, "--backend", "nvml"])  # last: over a --backend sim before


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
