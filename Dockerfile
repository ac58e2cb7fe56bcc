# The image `k2serve deploy` names (k2serve:<version>): k2serve with its GPU extras on CUDA.
#   docker build -t k2serve:0.1.0 .
# torch comes from PyTorch's CUDA 12.8 wheel index (its wheels carry the CUDA libraries; the base
# image gives the matching driver-side setup and tools). Override with --build-arg.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG TORCH_VERSION=2.13.0

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/k2serve \
    PATH=/opt/k2serve/bin:$PATH \
    HF_HOME=/models/.cache/huggingface

# python3 + venv; curl for probes and the SLURM / Kubernetes helper scripts
# (the distribution's current versions: pinning them breaks the build when the mirror moves)
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv curl ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/k2serve

# the CUDA build of torch first, so that installing k2serve does not pull the CPU one
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

WORKDIR /opt/k2serve-src
COPY pyproject.toml README.md ./
COPY src ./src
# the package itself, from this checkout (its dependencies are ranged in pyproject.toml)
# hadolint ignore=DL3013
RUN pip install ".[gpu]" \
    && k2serve --version

RUN useradd --create-home --uid 1000 k2serve \
    && mkdir -p /models \
    && chown k2serve:k2serve /models
USER 1000
WORKDIR /home/k2serve

EXPOSE 8000
ENTRYPOINT ["k2serve"]
CMD ["serve", "--help"]
