"""On a machine with an NVIDIA GPU: the NVML backend against the real driver.

Every core metric must be either present or listed as unsupported with NVML's own
reason; nothing may silently vanish. Deselected (with the reason) without a GPU.
"""

import pytest

from clusterpulse.agent.backends.nvml import FIELDS, NvmlBackend
from clusterpulse.agent.exporter import GPU_SERIES

pytestmark = pytest.mark.gpu

CORE = {attr for attr, *_ in GPU_SERIES} | {"clock_events", "ecc_corrected_total",
                                            "ecc_uncorrected_total"}


def test_every_core_metric_is_present_or_reported_unsupported():
    backend = NvmlBackend()
    try:
        backend.collect()
        samples = backend.collect()
        assert samples, "the driver reports no GPU"
        unsupported = backend.unsupported()
        report = []
        for s in samples:
            assert s.up, f"gpu {s.index} is down: {s.down_reason}"
            assert s.uuid.startswith("GPU-") and s.name
            for attr in sorted(CORE):
                value = getattr(s, attr)
                groups = {"memory_used_bytes": "memory", "memory_total_bytes": "memory"}
                key = (s.index, groups.get(attr, attr))
                assert value is not None or key in unsupported, f"gpu {s.index}: {attr} missing"
                shown = value if value is not None else f"unsupported: {unsupported[key]}"
                report.append(f"gpu{s.index} {attr} = {shown}")
        print("\n".join(report))
        assert 0 <= samples[0].utilization_ratio <= 1
        assert samples[0].memory_total_bytes > 1e9
        calls = sum(backend.calls.values())
        print(f"NVML calls for {len(samples)} GPUs x 2 cycles incl. init: {calls}; "
              f"fields per batched call: {len(FIELDS)}")
    finally:
        backend.close()
