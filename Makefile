# The two commands of the README. Both set up .venv first (idempotent).
.PHONY: run test bench setup
run:
	bash launch/setup_env.sh
	.venv/bin/qurl train --config launch/configs/cpu_demo.yaml
test:
	bash launch/setup_env.sh --with-test
	.venv/bin/python -m pytest -q tests
bench:
	bash launch/setup_env.sh
	.venv/bin/python benchmarks/quant_throughput.py
