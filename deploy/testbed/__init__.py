"""The multi-node testbed: Linux network namespaces on a bridge, one per node.

Import it from the repository root (tests, benchmarks and the demo run from there):

    from deploy.testbed import Testbed, TestbedError, missing_privileges

`python -m deploy.testbed --help` brings one up by hand and cleans up dead runs.
See docs/testbed.md.
"""

from deploy.testbed.bed import Node, Testbed
from deploy.testbed.net import TestbedError, missing_privileges

__all__ = ["Node", "Testbed", "TestbedError", "missing_privileges"]
