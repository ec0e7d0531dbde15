"""The agent's command line: a node name that would break what is built from it is
refused at start, in one line."""

from __future__ import annotations

import pytest

from clusterpulse.agent.cli import NODE_NAME, main


@pytest.mark.parametrize("node", ['gpu"7', "gpu\\7", "gpu 7", "", "-gpu", "x" * 254])
def test_a_node_name_that_would_break_the_alerts_queries_is_refused(node, capsys):
    """The link alert's templates query the node's evidence by its label
    (`{node="..."}`): a quote or a backslash in the name broke them, and the alert was
    sent without its evidence."""
    assert main(["--backend", "sim", "--listen", "127.0.0.1:0", f"--node={node}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("clusterpulse-agent: error: --node must be a host name"), err


@pytest.mark.parametrize("node", ["node-0", "gpu_001", "ip-10-0-3-7.ec2.internal",
                                  "DGX-A100-07", "x" * 253])
def test_host_kubernetes_and_slurm_node_names_are_accepted(node):
    assert NODE_NAME.fullmatch(node)
