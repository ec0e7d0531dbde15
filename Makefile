# Convenience targets; the README's two commands are scripts/demo.sh and scripts/test.sh.
.PHONY: setup test demo bench lint chaos
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
chaos: setup  # the multi-node chaos run (root: network namespaces); MINUTES=30 SEED=1
	.venv/bin/python -m tests.bench.chaos --minutes $${MINUTES:-30} --seed $${SEED:-1}
