# The firsttoken image: API, GPU worker, CPU worker and the migration job of compose.yaml.
#
#   docker build -t firsttoken:latest .          (compose.yaml: `build: .`)
#
# GPU workers need the NVIDIA container runtime; the same image runs the CPU-only services (torch
# falls back to the CPU when no GPU is visible). The CUDA runtime comes with the torch wheel; the
# base image supplies a matching userland, and the host's driver must support its CUDA version.
ARG BASE_IMAGE=nvidia/cuda:13.0.1-runtime-ubuntu24.04
FROM ${BASE_IMAGE}

# gcc and the Python headers: Triton compiles its kernel launchers with the system C compiler
# at first use.
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3 python3-venv python3-dev gcc ca-certificates \
    && rm -rf /var/lib/apt/lists/*

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/app \
    TRITON_CACHE_DIR=/tmp/triton \
    HF_HOME=/tmp/hf
RUN python3 -m venv "$VIRTUAL_ENV"

WORKDIR /app
COPY pyproject.toml README.md ./
COPY schemas schemas
COPY pipeline pipeline
COPY workers workers
COPY kernels kernels
COPY firsttoken firsttoken
# crc32c: kafka-python checksums every record batch with CRC32C, in pure Python (a few MB/s)
# unless this C implementation is installed.
RUN pip install --upgrade pip && pip install . crc32c

# `alembic upgrade head` (the migrate service) runs from /app: alembic.ini and migrations/.
COPY alembic.ini ./
COPY migrations migrations

RUN useradd --system --uid 10001 --home-dir /app --shell /usr/sbin/nologin firsttoken \
    && chown -R firsttoken /app
USER firsttoken

EXPOSE 8000
# compose.yaml gives each service its command (firsttoken api, celery ... worker, alembic).
CMD ["firsttoken", "--help"]
