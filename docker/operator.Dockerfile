# syntax=docker/dockerfile:1
# The hybridflow operator: kopf, the Kubernetes client and hybridflow.api (pydantic). No torch, no Ray:
# the operator only renders manifests, so the image stays small and quick to pull.
#
#   docker build -f docker/operator.Dockerfile -t docker.io/hybridflow/operator:0.1.0 .
#
# The tag is the chart's appVersion (charts/hybridflow/values.yaml: image.repository, image.tag).
# The project requires Python >= 3.11; Debian bookworm's is 3.11 (the stand-in base, docker/base/).
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md* ./
COPY runtime ./runtime
COPY operator ./operator
# A virtual environment copies cleanly into the final stage, without the build's caches. Wheels persist
# in a build cache mount (as in runtime.Dockerfile): `pip wheel` downloads only those the wheelhouse
# lacks and builds the project's, then pip installs from the wheelhouse alone.
RUN --mount=type=cache,target=/root/.cache/wheels \
    python -m venv /opt/hybridflow \
 && /opt/hybridflow/bin/pip wheel --wheel-dir /root/.cache/wheels ".[operator]" \
 && /opt/hybridflow/bin/pip install --no-index --find-links /root/.cache/wheels "hybridflow[operator]" \
 && /opt/hybridflow/bin/python -c "import hybridflow_operator, hybridflow_operator.install_check, hybridflow.api, kopf" \
 && ! /opt/hybridflow/bin/python -c "import torch" 2>/dev/null \
 && ! /opt/hybridflow/bin/python -c "import ray" 2>/dev/null

FROM python:${PYTHON_VERSION}-slim
LABEL org.opencontainers.image.title="hybridflow-operator" \
      org.opencontainers.image.description="Kubernetes operator that runs RLTrainingJobs as KubeRay RayJobs" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /opt/hybridflow /opt/hybridflow
# The chart mounts the root filesystem read-only with an emptyDir at /tmp: no bytecode files, and
# HOME points somewhere writable for libraries that look there.
ENV PATH=/opt/hybridflow/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
# 65532 is the conventional "nonroot" uid; the chart's securityContext runs as the same uid. It needs a
# passwd entry: kopf names its peering identity after the user (getpass.getuser()), and fails without one.
RUN groupadd --system --gid 65532 nonroot \
 && useradd --system --uid 65532 --gid 65532 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin nonroot
USER 65532:65532
# kopf's liveness endpoint (--liveness=http://0.0.0.0:8080/healthz in the chart).
EXPOSE 8080
ENTRYPOINT ["python", "-m", "hybridflow_operator"]
CMD ["--standalone", "--liveness=http://0.0.0.0:8080/healthz"]
