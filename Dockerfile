# syntax=docker/dockerfile:1
# The gossipmesh node image: one daemon per container (BuildKit, the default builder).
#   docker build -t gossipmesh:cpu .                    slim CPU image (the default target)
#   docker build --target cuda -t gossipmesh:cuda .     CUDA image (torch's CUDA wheels + cupy)
#   docker build --build-arg TORCH_SOURCE="--index-url URL" .   CPU torch from elsewhere (cpu stage)
# Configure it with GOSSIPMESH_<OPTION> variables (see `gossipmesh node --help`), a TOML file
# mounted at /etc/gossipmesh/node.toml with GOSSIPMESH_CONFIG=/etc/gossipmesh/node.toml, and a
# key folder mounted at /etc/gossipmesh/keys: the node's CURVE pair (NODE_ID.key_secret, or the
# only *.key_secret there) and the public *.key of every node it admits; one pair for the whole
# mesh (`gossipmesh keygen keys --name mesh`) is the simplest. Flags after the image name go to
# `gossipmesh node`.

ARG PYTHON_IMAGE=python:3.11-slim
ARG TORCH_VERSION=2.13.0

FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
COPY pyproject.toml README.md node.py ./
COPY p2p p2p
COPY gossip gossip
COPY topologies topologies
COPY gossipmesh gossipmesh
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ${PYTHON_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    GOSSIPMESH_LISTEN=tcp://0.0.0.0:7000 \
    GOSSIPMESH_METRICS_PORT=9100 \
    GOSSIPMESH_METRICS_HOST=0.0.0.0 \
    GOSSIPMESH_KEYS=/etc/gossipmesh/keys \
    GOSSIPMESH_TRUSTED=/etc/gossipmesh/keys \
    GOSSIPMESH_REPORT=/var/lib/gossipmesh/report.json
RUN useradd --system --uid 10001 --home-dir /var/lib/gossipmesh --create-home gossipmesh \
    && mkdir -p /etc/gossipmesh/keys && chown -R gossipmesh /etc/gossipmesh/keys
WORKDIR /var/lib/gossipmesh
EXPOSE 7000 9100
# liveness: the daemon's own loop made progress lately (never tied to peers)
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ['GOSSIPMESH_METRICS_PORT'], timeout=4)"]
ENTRYPOINT ["gossipmesh", "node"]

FROM base AS cuda
ARG TORCH_VERSION
RUN --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    pip install --no-cache-dir "torch==${TORCH_VERSION}" \
    && pip install --no-cache-dir "$(ls /wheels/gossipmesh-*.whl)[gpu]"
USER gossipmesh

FROM base AS cpu
ARG TORCH_VERSION
# where pip takes torch from: its options after the requirement. Empty: pip's configured index
# (PyPI's torch is the CUDA build, GBs larger); --find-links DIR: a wheel folder mounted into the
# build (podman build -v DIR:DIR:ro); --index-url URL: a mirror of the CPU index
ARG TORCH_SOURCE="--index-url https://download.pytorch.org/whl/cpu"
RUN --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    pip install --no-cache-dir "torch==${TORCH_VERSION}" ${TORCH_SOURCE} \
    && pip install --no-cache-dir /wheels/gossipmesh-*.whl
USER gossipmesh
