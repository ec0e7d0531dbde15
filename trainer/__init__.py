"""ClusterPulse reference trainer and instrumentation API.

`trainer.instrument.Pulse` is the part any training loop can use; the rest is a
reference distributed trainer (launched by torchrun) built on it.
"""

RESTART_EXIT_CODE = 42  # a graceful checkpoint-restart: torchrun restarts the group
