# Stand-in for registry.k8s.io/pause:3.6 (containerd 1.6's default sandbox_image), the container
# that holds a pod's namespaces, for nodes that reach no registry: a static busybox (the context
# docker/build-images.sh prepares holds Debian's busybox-static) that sleeps forever. containerd stops
# a sandbox with SIGKILL, so it needs no signal handling.
FROM scratch
COPY busybox /bin/busybox
ENTRYPOINT ["/bin/busybox", "sleep", "infinity"]
