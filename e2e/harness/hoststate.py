"""Host-wide state that real nodes change, recorded before they start and put back after they stop.

A kubelet sets sysctls (vm.overcommit_memory, kernel.panic, kernel.panic_on_oops), kubelet and kube-proxy add
iptables chains, and kubelet, containerd and the CNI plugins write a few fixed paths whatever their flags say.
Everything else the real-node tier makes lives under its own work directory.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SYSCTLS = (
    "net.ipv4.ip_forward",  # stays 0; recorded in case a CNI plugin in gateway mode turns it on
    "vm.overcommit_memory",
    "kernel.panic",
    "kernel.panic_on_oops",
    "net.bridge.bridge-nf-call-iptables",
)
# Written by kubelet, containerd or the CNI plugins whatever their flags say; removed afterwards if absent before.
FIXED_PATHS = (
    "/var/lib/kubelet",
    "/var/log/containers",
    "/var/log/pods",
    "/var/lib/cni",
    "/run/containerd",
    "/usr/libexec/kubernetes",
)
IPTABLES = ("iptables", "ip6tables")
TABLES = ("filter", "nat", "mangle", "raw")
CGROUP_ROOT = Path("/sys/fs/cgroup")
KUBELET_CGROUP = "kubepods"


def _sysctl_path(name: str) -> Path:
    return Path("/proc/sys") / name.replace(".", "/")


def read_sysctl(name: str) -> str | None:
    path = _sysctl_path(name)
    return path.read_text().strip() if path.exists() else None


def write_sysctl(name: str, value: str) -> None:
    _sysctl_path(name).write_text(value)


def _save(tool: str) -> str:
    return subprocess.run([f"{tool}-save"], capture_output=True, text=True, check=True).stdout


def _tables(saved: str) -> set[str]:
    return {line[1:].strip() for line in saved.splitlines() if line.startswith("*")}


def _cgroup_dirs() -> list[Path]:
    """The kubelet's top-level cgroup in every mounted hierarchy (cgroup v1 has one per controller)."""
    if not CGROUP_ROOT.is_dir():
        return []
    return [h / KUBELET_CGROUP for h in CGROUP_ROOT.iterdir() if (h / KUBELET_CGROUP).is_dir()]


@dataclass
class HostSnapshot:
    """What the host looked like before the real nodes started."""

    sysctls: dict[str, str] = field(default_factory=dict)
    iptables: dict[str, str] = field(default_factory=dict)  # tool -> its *-save output
    absent_paths: list[str] = field(default_factory=list)
    had_cgroups: list[str] = field(default_factory=list)

    @classmethod
    def take(cls) -> HostSnapshot:
        sysctls = {n: v for n in SYSCTLS if (v := read_sysctl(n)) is not None}
        return cls(
            sysctls=sysctls,
            iptables={tool: _save(tool) for tool in IPTABLES if shutil.which(f"{tool}-save")},
            absent_paths=[p for p in FIXED_PATHS if not os.path.lexists(p)],
            had_cgroups=[str(d) for d in _cgroup_dirs()],
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> HostSnapshot:
        return cls(**data)

    def restore(self) -> list[str]:
        """Put every recorded item back; returns what could not be, so teardown reports it but goes on."""
        problems: list[str] = []
        for name, value in self.sysctls.items():
            try:
                if read_sysctl(name) != value:
                    write_sysctl(name, value)
            except OSError as exc:
                problems.append(f"sysctl {name}={value}: {exc}")
        for tool, saved in self.iptables.items():
            problems += _restore_iptables(tool, saved)
        for path in self.absent_paths:
            with contextlib.suppress(FileNotFoundError):
                if os.path.isdir(path) and not os.path.islink(path):
                    unmount_under(Path(path))
                    shutil.rmtree(path)
                else:
                    os.unlink(path)
        for cgroup in _cgroup_dirs():
            if str(cgroup) not in self.had_cgroups:
                problems += remove_cgroup_tree(cgroup)
        return problems


def _restore_iptables(tool: str, saved: str) -> list[str]:
    """Tables that existed go back to their saved rules; tables created since are deleted (nf_tables backend)
    or emptied (legacy, whose tables always exist)."""
    problems = []
    restore = subprocess.run([f"{tool}-restore"], input=saved, capture_output=True, text=True, check=False)
    if restore.returncode != 0:
        problems.append(f"{tool}-restore: {restore.stderr.strip()}")
    present = _tables(saved)
    family = "ip6" if tool == "ip6tables" else "ip"
    for table in TABLES:
        if table in present:
            continue
        for flag in ("-F", "-X"):
            subprocess.run([tool, "-t", table, flag], capture_output=True, check=False)
        if _nf_tables(tool) and shutil.which("nft"):
            subprocess.run(["nft", "delete", "table", family, table], capture_output=True, check=False)
    return problems


def _nf_tables(tool: str) -> bool:
    version = subprocess.run([tool, "--version"], capture_output=True, text=True, check=False).stdout
    return "nf_tables" in version


def kill_cgroup_processes(top: Path) -> None:
    """SIGKILL every process left in a cgroup tree (containers whose shim is gone keep running otherwise)."""
    for root, _, files in os.walk(top):
        if "cgroup.procs" not in files:
            continue
        with contextlib.suppress(OSError):
            for pid in Path(root, "cgroup.procs").read_text().split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), 9)


def remove_cgroup_tree(top: Path) -> list[str]:
    """rmdir a cgroup and its children, deepest first (a cgroup directory cannot be removed recursively)."""
    kill_cgroup_processes(top)
    time.sleep(0.5)  # the kernel reaps them before their cgroups can go
    problems = []
    for root, dirs, _ in sorted(os.walk(top), key=lambda entry: -entry[0].count("/")):
        del dirs
        try:
            os.rmdir(root)
        except OSError as exc:
            problems.append(f"cgroup {root}: {exc}")
    return problems


def mounts_under(directory: Path) -> list[str]:
    """Mount points at or below `directory`, deepest first."""
    prefix = str(directory.resolve()).rstrip("/")
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4].encode().decode("unicode_escape")
            if point == prefix or point.startswith(prefix + "/"):
                points.append(point)
    return sorted(set(points), key=lambda p: -p.count("/"))


def unmount_under(directory: Path) -> None:
    """Detach every mount below `directory`, so that removing it cannot reach into a mounted volume."""
    for point in mounts_under(directory):
        subprocess.run(["umount", "-l", point], capture_output=True, check=False)


def remove_tree(directory: Path) -> None:
    """Unmount, then delete without crossing into another filesystem."""
    if not directory.exists():
        return
    unmount_under(directory)
    subprocess.run(["rm", "-rf", "--one-file-system", str(directory)], check=False)
