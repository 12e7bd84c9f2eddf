# syntax=docker/dockerfile:1
# Stand-in for python:3.11-slim, tagged docker.io/library/python:3.11-slim, for building
# docker/operator.Dockerfile where no registry is reachable. Debian bookworm's Python 3.11 from the
# minbase rootfs; `python` and `pip` on PATH as in the upstream image. Upstream installs CPython
# under /usr/local; here it is Debian's package under /usr, which a Dockerfile cannot tell apart.
FROM localhost/hybridflow/debian:bookworm-minbase
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-pip python-is-python3 \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin \
 && { [ -e /usr/bin/pip ] || ln -s pip3 /usr/bin/pip; } \
 && rm -f /usr/lib/python3*/EXTERNALLY-MANAGED
# Upstream's pip installs into the system Python; Debian marks it externally managed (removed above).
ENV LANG=C.UTF-8
CMD ["python3"]
