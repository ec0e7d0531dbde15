# Convenience targets; the README's two commands are scripts/demo.sh and scripts/test.sh.
.PHONY: setup test demo bench bench-detection bench-fleet bench-event-rules bench-testbed bench-incidents bench-node lint chaos
setup:
	scripts/setup.sh
test:
	scripts/test.sh
demo:
	scripts/demo.sh
lint:
	.venv/bin/ruff check .
bench: setup
	.venv/bin/python -m tests.bench.run
bench-detection: setup  # straggler scenarios: ours, the previous scorer, NVRx's rule (~2 min)
	.venv/bin/python -m tests.bench.bench_detection_scenarios
bench-fleet: setup  # NODES=2048 (x 8 GPUs) STORES=prometheus,victoria,sharded (~3 min each)
	CLUSTERPULSE_FLEET_NODES=$${NODES:-2048} \
	  CLUSTERPULSE_FLEET_STORES=$${STORES:-prometheus,victoria,sharded} \
	  .venv/bin/python -m tests.bench.run --only bench_fleet
bench-event-rules: setup  # the XID/ECC records on an hour of 16,384 GPUs' history
	.venv/bin/python -m tests.bench.run --only bench_event_rules
bench-testbed: setup  # recovery on a 4-node testbed (root: network namespaces)
	.venv/bin/python -m tests.bench.run --only bench_testbed_recovery
bench-incidents: setup  # hangs and slow links end to end vs the previous rules (root: links)
	.venv/bin/python -m tests.bench.run --only bench_incidents
bench-node: setup  # a hung job, a flood and 200 veths vs healthy jobs alone (root, ~2 min)
	.venv/bin/python -m tests.bench.run --only bench_node
chaos: setup  # the multi-node chaos run (root: network namespaces); MINUTES=30 SEED=1 SPARES=1
	.venv/bin/python -m tests.bench.chaos --minutes $${MINUTES:-30} --seed $${SEED:-1} \
	  --baseline-minutes $${BASELINE_MINUTES:-$${MINUTES:-30}} --spares $${SPARES:-1}
