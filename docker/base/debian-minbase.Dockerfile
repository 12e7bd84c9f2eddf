# A Debian root filesystem made by `debootstrap --variant=minbase` (docker/build-images.sh makes and
# caches rootfs.tar), as an image: the common base of the stand-ins below. Built where no registry is
# reachable, so nothing is pulled; the stand-ins then install their packages from Debian's archive.
FROM scratch
ADD rootfs.tar /
ENV LANG=C.UTF-8
CMD ["bash"]
