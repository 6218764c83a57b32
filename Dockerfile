# The image every manifest under k8s/ runs (head, workers, job submitter). It installs the project exactly as the
# README does (scripts/bootstrap.sh), so there is one way to install.
#   CPU (the toy-cpu overlay):  docker build -t registry.example.com/mmspec-ray:0.1.0-cpu .
#   GPU (the gpu overlay):      docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#                                 -t registry.example.com/mmspec-ray:0.1.0-cuda .
# The default index is PyTorch's CPU one (PyPI's Linux torch is the CUDA build, several GB). CUDA torch wheels
# carry their CUDA runtime; the node's NVIDIA driver comes in through the device plugin.
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

# wget: KubeRay's default readiness / liveness probes call it.
RUN apt-get update && apt-get install -y --no-install-recommends wget && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY pyproject.toml README.md ./
COPY scripts/ scripts/
COPY mmspec_ray/ mmspec_ray/
COPY jobs/ jobs/
COPY deployments/ deployments/
RUN TORCH_INDEX_URL="$TORCH_INDEX_URL" bash scripts/bootstrap.sh

ENV PATH=/app/.venv/bin:$PATH \
    MMSPEC_HOME=/cache/mmspec \
    RAY_USAGE_STATS_ENABLED=0
