# Convenience targets; the README's two commands are scripts/demo.sh and scripts/test.sh.
.PHONY: setup test demo bench bench-fleet lint chaos
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
bench-fleet: setup
	.venv/bin/python -m tests.bench.run --only bench_fleet
chaos: setup  # the multi-node chaos run (root: network namespaces); MINUTES=30 SEED=1
	.venv/bin/python -m tests.bench.chaos --minutes $${MINUTES:-30} --seed $${SEED:-1}
