#!/usr/bin/env bash
# Install what a real kubelet node and the image builds need, from Debian: containerd, runc, the CNI
# plugins, iptables, nftables and conntrack (kube-proxy; teardown), busybox-static (the pause image), debootstrap, buildah,
# umoci and skopeo (images without a Docker engine); prometheus, the server e2e/test_prometheus.py scrapes
# a live run and the operator with; chromium, the headless browser tests/test_dashboard_browser.py drives.
#
#   sudo e2e/toolchain/install-node-packages.sh        (idempotent: seconds when all are present)
#
# Nothing is started or enabled: the harness runs containerd itself, with its own paths.
set -euo pipefail

PACKAGES=(containerd runc containernetworking-plugins iptables conntrack busybox-static
          debootstrap buildah umoci skopeo fuse-overlayfs nftables prometheus chromium)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [[ ${#missing[@]} -eq 0 ]]; then
  echo "install-node-packages: all ${#PACKAGES[@]} packages present"
  exit 0
fi
if [[ $(id -u) -ne 0 ]]; then
  echo "install-node-packages: missing ${missing[*]}; run this script as root" >&2
  # Outside CI the real-node tests then skip, saying why; under CI=true they must run.
  [[ ${CI:-} == true ]] && exit 2
  exit 0
fi
start=$SECONDS
export DEBIAN_FRONTEND=noninteractive
# A package's maintainer script must not start a system containerd (or Prometheus) next to the harness's own.
policy=/usr/sbin/policy-rc.d
created_policy=0
if [[ ! -e $policy ]]; then
  printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy" && created_policy=1
fi
trap '[[ $created_policy -eq 1 ]] && rm -f "$policy"' EXIT
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "install-node-packages: installed ${missing[*]} in $((SECONDS - start))s"
