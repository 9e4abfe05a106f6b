# DeepInfer Gateway image: one image for every role.
#
#   docker build -t deepinfer-gateway:local .
#   docker run --rm -p 8000:8000 deepinfer-gateway:local                      # demo (default CMD; prints its API key)
#   docker run ... deepinfer-gateway:local serve --config /etc/deepinfer-gateway/gateway.toml
#   docker run ... deepinfer-gateway:local worker --engine sim --role prefill --hardware sm100 \
#                                             --host 0.0.0.0 --port 8100
#
# The real `worker --engine deepinfer` needs DeepInfer (Python 3.12, CUDA 13 or CANN 9.2)
# in the image: build FROM your accelerator base image instead (see docs/deploy.md).
#
# Build args:
#   BASE_IMAGE      the base of both stages; default python:3.11-slim-bookworm pinned by
#                   digest, so a rebuild gets the same base
#   PYTHON_VERSION  e.g. 3.12 (DeepInfer's version): python:<version>-slim-bookworm by tag,
#                   unpinned, or a local image of that name (the gateway needs >= 3.11)
#   EXTRAS          optional extras of the package (locked too); default "[epp]": the EPP
#                   manifests (deploy/k8s/epp) run this image as `deepinfer-gateway epp`,
#                   whose gRPC server needs that extra; e.g. "[epp,bench]" for more
# No `# syntax=` line: BuildKit's built-in frontend builds this file (RUN --mount included),
# so a build fetches no frontend image; with the base image local and deploy/wheels filled,
# it needs no registry at all.
# As PID 1 (no init in the container) the entrypoint is its own init: it passes stop signals
# on and reaps orphans (deepinfer_gateway/process/container_init.py).
# Dependencies come from requirements.lock (exact versions and hashes; docs/deploy.md says
# how to regenerate it). Wheels that are not on your index (air-gapped sites) can be
# dropped into deploy/wheels/ before the build: the builder looks there first, and their
# hashes must match the lock.

ARG PYTHON_VERSION=""
ARG PYTHON_BASE=${PYTHON_VERSION:+python:}${PYTHON_VERSION}${PYTHON_VERSION:+-slim-bookworm}
ARG BASE_IMAGE=${PYTHON_BASE:-python:3.11-slim-bookworm@sha256:a36c24f9cbdf4fd0f52d67f0823eeac19c2028c637cecc392d97f980d4fec56b}

# ---------------------------------------------------------------- builder: wheels only
FROM ${BASE_IMAGE} AS builder
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
WORKDIR /build
COPY deploy/wheels/ /build/local-wheels/
COPY requirements.lock pyproject.toml README.md ./
COPY deepinfer_gateway/ ./deepinfer_gateway/
# Every locked dependency's wheel (the extras' too, so EXTRAS installs locked versions),
# then the project's own; the runtime installs from here only.
RUN python -m pip wheel --wheel-dir /wheels --find-links /build/local-wheels --require-hashes -r requirements.lock \
 && python -m pip wheel --wheel-dir /wheels --no-deps .

# ---------------------------------------------------------------- runtime: slim, non-root
FROM ${BASE_IMAGE} AS runtime
ARG EXTRAS="[epp]"
LABEL org.opencontainers.image.title="deepinfer-gateway" \
      org.opencontainers.image.description="OpenAI/Anthropic gateway, KV-cache-aware router and simulated engine workers for DeepInfer" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN groupadd --system --gid 10001 dgw \
 && useradd --system --uid 10001 --gid dgw --home-dir /home/dgw --create-home --shell /usr/sbin/nologin dgw \
 && mkdir -p /etc/deepinfer-gateway
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    python -m pip install --no-index --find-links /wheels "deepinfer-gateway${EXTRAS}" \
 && deepinfer-gateway --help > /dev/null \
 && case "${EXTRAS}" in *epp*) deepinfer-gateway epp --help > /dev/null \
      && python -c "import deepinfer_gateway.epp.runtime" ;; esac

USER 10001:10001
WORKDIR /home/dgw
# Tokenizer-derived tables in ~/.cache/deepinfer-gateway, read at every start: built here,
# containers start ~1 s sooner, also under a read-only root filesystem (deploy/k8s).
RUN deepinfer-gateway warm-cache
# 8000: gateway (serve, demo); 8100: a worker's default port
EXPOSE 8000 8100

# No curl in the image: the probe is Python. podman keeps HEALTHCHECK only with `--format docker`. HEALTHCHECK_URL overrides the target (workers:
# http://127.0.0.1:8100/health); otherwise the gateway's port from DGW_PORT (default 8000).
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request as u; url = os.environ.get('HEALTHCHECK_URL') or 'http://127.0.0.1:%s/health' % os.environ.get('DGW_PORT', '8000'); u.urlopen(url, timeout=2).close()"]

ENTRYPOINT ["deepinfer-gateway"]
CMD ["demo", "--host", "0.0.0.0", "--port", "8000"]
