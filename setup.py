import re
from pathlib import Path

from setuptools import find_packages, setup

# one version: the package's own __version__ (what `qurl --version` prints when the package is not installed)
VERSION = re.search(r'__version__ = "([^"]+)"', (Path(__file__).parent / "qurl_mcore" / "__init__.py").read_text())[1]


def requirements(name: str) -> list[str]:
    """The requirements of requirements/NAME.txt (one place for an extra's pins)."""
    lines = (Path(__file__).parent / "requirements" / f"{name}.txt").read_text().splitlines()
    return [line.split("#")[0].strip() for line in lines if line.split("#")[0].strip()]


setup(
    name="qurl-mcore",
    version=VERSION,
    description="Quantized-rollout RL (QuRL, MoEResQ) for Megatron-Core training and SGLang rollout",
    license="Apache-2.0",
    license_files=["LICENSE"],
    classifiers=["Typing :: Typed"],
    packages=find_packages(include=["qurl_mcore", "qurl_mcore.*"]),
    package_data={"qurl_mcore": ["py.typed"]},
    python_requires=">=3.10",
    # Runtime pins live in requirements/{cpu,gpu}.txt: the CPU and GPU environments take different torch builds.
    install_requires=["torch>=2.6", "numpy"],
    # wandb: logging.wandb_project (requirements/wandb.txt)
    extras_require={"test": ["pytest>=8.0", "hypothesis>=6.100", "scipy>=1.11"], "wandb": requirements("wandb")},
    entry_points={
        "console_scripts": ["qurl=qurl_mcore.cli:main"],
        # SGLang loads these in every one of its processes: the qurl_* quantization methods.
        "sglang.srt.plugins": ["qurl=qurl_mcore.sglang:register"],
    },
)
