# The two commands of the README (run, test), plus the fast lane and the benchmarks. Each sets up .venv
# first (idempotent). The tests run on two pytest-xdist workers, a file to a worker (tests/conftest.py): most
# of a loop test is processes starting, which leaves a core idle. TEST_WORKERS=0 runs them in this process.
.PHONY: run test test-fast bench
TEST_WORKERS ?= 2
XDIST = -n $(TEST_WORKERS) --no-loadscope-reorder
run:
	bash launch/setup_env.sh
	.venv/bin/qurl train --config launch/configs/cpu_demo.yaml
test:
	bash launch/setup_env.sh --with-test
	.venv/bin/python -m pytest -q $(XDIST) --durations=60 tests
test-fast:
	bash launch/setup_env.sh --with-test
	.venv/bin/python -m pytest -q $(XDIST) -m "not slow" tests
bench:
	bash launch/setup_env.sh
	.venv/bin/python benchmarks/quant_throughput.py
