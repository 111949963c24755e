# qurl-mcore for GPU clusters (H100/H200/B200, CUDA 13 drivers): docs/launch.md, "Container image".
#   docker build -t qurl-mcore .
# The base is pinned by tag: PyTorch 2.14.1 built for CUDA 13.0, the torch of requirements/gpu.txt and the CUDA
# of PyPI's torch 2.14.1 wheel, so step 1 keeps the image's torch instead of downloading another. "devel", not
# "runtime": step 2 compiles Transformer Engine's torch extension and needs nvcc.
# Every `pip install` below is resolved, as written, by tests/test_environment.py (pip install --dry-run).
FROM pytorch/pytorch:2.14.1-cuda13.0-cudnn9-devel

# The image is the environment: pip installs into its Python, even where that is marked externally managed.
ENV PIP_BREAK_SYSTEM_PACKAGES=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1

WORKDIR /opt/qurl-mcore

# Requirements before the source, so that a code change rebuilds only the last layer.
COPY requirements/gpu.txt requirements/gpu-te.txt requirements/

# The Python the dry run resolves the pip steps for (tests/test_environment.py reads it here): the build stops
# if the base image's Python is another.
ARG PYTHON=3.12

# Step 1: one set of binary wheels (requirements/gpu.txt).
RUN python3 -c "import sys; v = '%d.%d' % sys.version_info[:2]; assert v == '${PYTHON}', v" \
    && python3 -m pip install --no-cache-dir --only-binary :all: -r requirements/gpu.txt

# Step 2: TE's torch extension, compiled against step 1's torch (requirements/gpu-te.txt says why). Its own
# layer: a failed compile is retried without downloading step 1's GBs again.
# hadolint ignore=DL3059
RUN python3 -m pip install --no-cache-dir --no-build-isolation -r requirements/gpu-te.txt

COPY . .

# The package itself, editable as in the README: `qurl patch` and the verl hook read the checkout's patches/;
# its dependencies are steps 1 and 2.
RUN python3 -m pip install --no-cache-dir --no-deps -e . \
    && qurl --version

CMD ["qurl", "--help"]
