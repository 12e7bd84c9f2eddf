# syntax=docker/dockerfile:1
# The Ray head and worker image for RLTrainingJobs: rayproject/ray (GPU) at the default
# spec.cluster.rayVersion, plus torch, vLLM and hybridflow with its runtime extras.
#
#   docker build -f docker/runtime.Dockerfile -t docker.io/hybridflow/runtime:0.1.0 .
#
# The operator uses this image when a job leaves spec.cluster.image empty (chart value runtimeImage,
# default docker.io/hybridflow/runtime:<appVersion>). Keep RAY_VERSION equal to the default
# spec.cluster.rayVersion: KubeRay starts the cluster with that version and the image's Ray must match.
ARG RAY_VERSION=2.60.0
ARG PYTHON_TAG=py311
ARG ACCELERATOR_TAG=gpu

FROM rayproject/ray:${RAY_VERSION}-${PYTHON_TAG}-${ACCELERATOR_TAG}
ARG RAY_VERSION
# Empty: the newest vLLM; set it to pin (vLLM in turn pins the torch it was built against).
ARG VLLM_VERSION=
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1
LABEL org.opencontainers.image.title="hybridflow-runtime" \
      org.opencontainers.image.description="Ray image with torch, vLLM and the hybridflow runtime" \
      org.opencontainers.image.licenses="Apache-2.0"

# torch and vLLM in one resolver run, so pip picks the torch build vLLM was compiled for.
RUN pip install torch "vllm${VLLM_VERSION:+==${VLLM_VERSION}}"

WORKDIR /home/ray/hybridflow
COPY --chown=ray:users pyproject.toml README.md* ./
COPY --chown=ray:users runtime ./runtime
COPY --chown=ray:users operator ./operator
RUN pip install ".[runtime,vllm]" \
 && python -c "import ray, torch, vllm, hybridflow; \
assert ray.__version__ == '${RAY_VERSION}', f'pip replaced Ray {ray.__version__}: pin it'"

WORKDIR /home/ray
# KubeRay sets the command of head and worker pods (ray start ...), so no ENTRYPOINT here.
