# syntax=docker/dockerfile:1
# Stand-in for rayproject/ray:<RAY_VERSION>-py311-cpu, tagged docker.io/rayproject/ray:2.60.0-py311-cpu,
# for building docker/runtime.Dockerfile with ACCELERATOR_TAG=cpu where no registry is reachable.
# It gives a Dockerfile what the upstream image does: a `ray` user (uid 1000, group users, home
# /home/ray) that the following instructions run as, a Python whose `python` and `pip` are on PATH
# and writable by that user (upstream: conda under /home/ray/anaconda3; here a venv under
# /home/ray/venv), ray[default] (the dashboard: KubeRay submits jobs through it), bash, wget (KubeRay's
# probes) and ca-certificates. Not here: conda, sudo, CUDA.
FROM docker.io/library/python:3.11-slim
ARG RAY_VERSION=2.60.0
RUN apt-get update \
 && apt-get install -y --no-install-recommends bash wget ca-certificates \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin \
 && useradd --uid 1000 --gid users --create-home --home-dir /home/ray --shell /bin/bash ray
USER ray
ENV HOME=/home/ray \
    PATH=/home/ray/venv/bin:$PATH \
    LANG=C.UTF-8
WORKDIR /home/ray
# ~/.cache made by its user: a cache mount below it would otherwise create it for root, and the runtime
# (Hugging Face, hybridflow's built-in model) could not write there.
RUN python -m venv /home/ray/venv && mkdir -p /home/ray/.cache
# Wheels persist in a build cache mount shared with runtime.Dockerfile (the comment there says why).
RUN --mount=type=cache,target=/home/ray/.cache/wheels,uid=1000,gid=100 \
    pip download --disable-pip-version-check --dest /home/ray/.cache/wheels "ray[default]==${RAY_VERSION}" \
 && pip install --disable-pip-version-check --no-index --find-links /home/ray/.cache/wheels \
      "ray[default]==${RAY_VERSION}" \
 && python -c "import ray, ray.dashboard; assert ray.__version__ == '${RAY_VERSION}'"
CMD ["bash"]
