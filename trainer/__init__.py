"""ClusterPulse reference trainer and instrumentation API.

`trainer.instrument.Pulse` and `trainer.parallel.init_distributed` are the parts any
training loop can use (see examples/ddp_tutorial.py); the rest is a reference
distributed trainer (launched by torchrun or clusterpulse-train) built on them.
"""

RESTART_EXIT_CODE = 42  # graceful checkpoint-restart under a plain torchrun
PREEMPTED_EXIT_CODE = 143  # 128 + SIGTERM: checkpointed after SIGTERM, requeue to resume
