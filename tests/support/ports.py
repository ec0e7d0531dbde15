"""Free loopback ports for test servers: the local demo's picker (deploy/local/stack.py
free_port), which keeps clear of the ephemeral ports and of the 100-port blocks the
demo's tests give their clusters (20000-29999)."""

from deploy.local.stack import free_port

__all__ = ["free_port"]
