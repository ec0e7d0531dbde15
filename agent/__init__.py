"""ClusterPulse node agent: GPU health and trainer telemetry exported to Prometheus."""

__version__ = "0.1.0"
