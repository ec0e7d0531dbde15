# Convenience targets; the README's two commands are scripts/demo.sh and scripts/test.sh.
.PHONY: setup test demo bench bench-fleet lint
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
