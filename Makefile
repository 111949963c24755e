# The two commands of the README (run, test), plus the fast lane and the benchmarks. Each sets up .venv
# first (idempotent).
.PHONY: run test test-fast bench
run:
	bash launch/setup_env.sh
	.venv/bin/qurl train --config launch/configs/cpu_demo.yaml
test:
	bash launch/setup_env.sh --with-test
	.venv/bin/python -m pytest -q --durations=60 tests
test-fast:
	bash launch/setup_env.sh --with-test
	.venv/bin/python -m pytest -q -m "not slow" tests
bench:
	bash launch/setup_env.sh
	.venv/bin/python benchmarks/quant_throughput.py
