# syntax=docker/dockerfile:1
# The Ray head and worker image for RLTrainingJobs: rayproject/ray (GPU) at the default
# spec.cluster.rayVersion, plus torch, vLLM and hybridflow with its runtime extras.
#
#   docker build -f docker/runtime.Dockerfile -t docker.io/hybridflow/runtime:0.1.0 .
#
# CPU nodes (no vLLM: its wheels need CUDA; rollout then generates with torch), as `make images` builds it:
#
#   docker build -f docker/runtime.Dockerfile --build-arg ACCELERATOR_TAG=cpu --build-arg WITH_VLLM=0 \
#     -t docker.io/hybridflow/runtime:0.1.0-cpu .
#
# With experiment trackers for spec.trainer.loggers (pyproject's extras tensorboard, mlflow, wandb; trackers: all):
#
#   docker build -f docker/runtime.Dockerfile --build-arg EXTRAS=tensorboard,wandb -t my.registry/runtime:0.1.0 .
#
# The operator uses this image when a job leaves spec.cluster.image empty (chart value runtimeImage,
# default docker.io/hybridflow/runtime:<appVersion>; set it to the -cpu tag on CPU-only clusters). Keep
# RAY_VERSION equal to the default spec.cluster.rayVersion: KubeRay starts the cluster with that version
# and the image's Ray must match.
ARG RAY_VERSION=2.60.0
ARG PYTHON_TAG=py311
ARG ACCELERATOR_TAG=gpu

FROM rayproject/ray:${RAY_VERSION}-${PYTHON_TAG}-${ACCELERATOR_TAG}
ARG RAY_VERSION
# Empty: the newest vLLM; set it to pin (vLLM in turn pins the torch it was built against).
ARG VLLM_VERSION=
# 1: torch and vLLM (GPU images). 0: torch alone, for ACCELERATOR_TAG=cpu.
ARG WITH_VLLM=1
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1
LABEL org.opencontainers.image.title="hybridflow-runtime" \
      org.opencontainers.image.description="Ray image with torch, vLLM and the hybridflow runtime" \
      org.opencontainers.image.licenses="Apache-2.0"

# Wheels persist in a build cache mount: `pip download` fetches only those the wheelhouse lacks and pip
# installs from it, so a rebuild does not fetch gigabytes again (pip's own HTTP cache keeps nothing when
# the index's responses carry no caching headers, as behind some proxies). torch and vLLM in one
# resolver run, so pip picks the torch build vLLM was compiled for.
RUN --mount=type=cache,target=/home/ray/.cache/wheels,uid=1000,gid=100 \
    if [ "$WITH_VLLM" = 1 ]; then set -- torch "vllm${VLLM_VERSION:+==${VLLM_VERSION}}"; else set -- torch; fi \
 && pip download --dest /home/ray/.cache/wheels "$@" \
 && pip install --no-index --find-links /home/ray/.cache/wheels "$@"

WORKDIR /home/ray/hybridflow
# The project's dependencies first, read from pyproject.toml alone: a change to the code leaves this layer
# cached. Ray, torch (and vLLM) stay at the versions installed above. `pip wheel` adds to the wheelhouse what
# it lacks; pip then installs from the wheelhouse alone.
COPY --chown=ray:users pyproject.toml ./
# More of pyproject's optional extras, comma-separated: tensorboard, mlflow, wandb, or trackers (all three); empty:
# none. Declared here, so the layers above stay cached whatever it is.
ARG EXTRAS=
RUN --mount=type=cache,target=/home/ray/.cache/wheels,uid=1000,gid=100 \
    extras=runtime; installed=torch; \
    if [ "$WITH_VLLM" = 1 ]; then extras=runtime,vllm; installed="torch vllm"; fi; \
    extras="$extras${EXTRAS:+,$EXTRAS}"; \
    python -c "import sys, tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
x = p['optional-dependencies']; e = [n.strip() for n in sys.argv[1].split(',') if n.strip()]; \
bad = [n for n in e if n not in x]; \
bad and sys.exit(f'EXTRAS: no extra {bad} in pyproject.toml; there are {sorted(x)}'); \
me = p['name'] + '['; \
f = lambda n: [d for r in x[n] \
 for d in ([q for k in r[len(me):-1].split(',') for q in f(k)] if r.startswith(me) else [r])]; \
print('\n'.join(p['dependencies'] + [d for n in e for d in f(n)]))" \
      "$extras" > /tmp/requirements.txt || exit 1; \
    set -- "ray[default]==${RAY_VERSION}"; \
    for p in $installed; do set -- "$@" "$p==$(pip show "$p" | sed -n 's/^Version: //p')"; done; \
    pip wheel --wheel-dir /home/ray/.cache/wheels -r /tmp/requirements.txt "$@" "setuptools>=69" \
 && pip install --no-index --find-links /home/ray/.cache/wheels -r /tmp/requirements.txt "$@"

COPY --chown=ray:users README.md* ./
COPY --chown=ray:users runtime ./runtime
COPY --chown=ray:users operator ./operator
# The project alone: its build backend (setuptools) comes from the wheelhouse too.
RUN --mount=type=cache,target=/home/ray/.cache/wheels,uid=1000,gid=100 \
    pip install --no-deps --no-index --find-links /home/ray/.cache/wheels . \
 && python -c "import ray, torch, hybridflow; \
assert ray.__version__ == '${RAY_VERSION}', f'pip replaced Ray {ray.__version__}: pin it'" \
 && { [ "$WITH_VLLM" != 1 ] || python -c "import vllm"; }

WORKDIR /home/ray
# KubeRay sets the command of head and worker pods (ray start ...), so no ENTRYPOINT here.
