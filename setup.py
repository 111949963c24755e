from setuptools import find_packages, setup

setup(
    name="qurl-mcore",
    version="0.1.0",
    description="Quantized-rollout RL (QuRL, MoEResQ) for Megatron-Core training and SGLang rollout",
    packages=find_packages(include=["qurl_mcore", "qurl_mcore.*"]),
    python_requires=">=3.10",
    # Runtime pins live in requirements/{cpu,gpu}.txt: the CPU and GPU environments take different torch builds.
    install_requires=["torch>=2.6", "numpy"],
    extras_require={"test": ["pytest>=8.0", "hypothesis>=6.100", "scipy>=1.11"]},
    entry_points={
        "console_scripts": ["qurl=qurl_mcore.cli:main"],
        # SGLang loads these in every one of its processes: the qurl_* quantization methods.
        "sglang.srt.plugins": ["qurl=qurl_mcore.sglang:register"],
    },
)
