"""ClusterPulse distribution helpers that belong to no single component.

The shipped configuration (Prometheus rules, Alertmanager routing, the remediation
policy example, Grafana dashboards, systemd units) lives in the repository's
``deploy/`` folder; ``clusterpulse/deploy`` links to it so that the same files are
package data in the wheel and need no copy kept in sync by hand.
"""

__version__ = "0.1.0"
