# The image of the fast real-node test tier's pods, tagged docker.io/hybridflow/node-base:bookworm:
# the minbase rootfs with bash, coreutils, wget and ca-certificates, and no Python. The tier mounts the
# host's Python and venv read-only at their host paths, so the shared libraries a CPython build and
# its extension modules load on Debian bookworm are installed here too.
FROM localhost/hybridflow/debian:bookworm-minbase
RUN apt-get update \
 && apt-get install -y --no-install-recommends bash coreutils wget ca-certificates \
      libssl3 libffi8 libsqlite3-0 libbz2-1.0 liblzma5 zlib1g libreadline8 libncursesw6 libgdbm6 \
      libuuid1 libexpat1 libtirpc3 \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin
CMD ["bash"]
