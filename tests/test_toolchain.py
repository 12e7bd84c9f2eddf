"""The control plane's component table (e2e/toolchain/components.tsv) and `build.sh --version`: what the build,
the harness, make and the kind script all ask. No Go needed."""

from __future__ import annotations

import re
import subprocess

import pytest

from e2e.harness import binaries


def _go_mod(wrapper: str) -> str:
    return (binaries.TOOLCHAIN_DIR / wrapper / "go.mod").read_text()


def _tools(go_mod: str) -> set[str]:
    """The packages of a go.mod's `tool` directives, single-line or in a block."""
    block = re.search(r"^tool \($(.*?)^\)", go_mod, re.MULTILINE | re.DOTALL)
    listed = block.group(1).split() if block else []
    return set(listed) | set(re.findall(r"^tool (\S+)$", go_mod, re.MULTILINE)) - {"("}


@pytest.mark.parametrize("name", sorted(binaries.COMPONENTS))
def test_version_is_the_one_its_wrapper_requires(name: str) -> None:
    component = binaries.COMPONENTS[name]
    found = binaries.version(name)
    assert re.fullmatch(r"v\d+\.\d+\.\d+", found), found
    requires = re.findall(rf"^\s*(?:require\s+)?{re.escape(component.module)}[ \t]+(v\S+)", _go_mod(component.wrapper),
                          re.MULTILINE)
    assert requires == [found]


@pytest.mark.parametrize("name", sorted(n for n, c in binaries.COMPONENTS.items() if c.binary))
def test_every_binary_is_a_tool_or_a_main_package_of_its_wrapper(name: str) -> None:
    """`go mod tidy` keeps only what a tool line or the wrapper's own packages need: a binary that is neither
    would lose its dependencies."""
    component = binaries.COMPONENTS[name]
    go_mod = _go_mod(component.wrapper)
    module = re.search(r"^module (\S+)$", go_mod, re.MULTILINE)
    assert module is not None
    own = component.package.removeprefix(module.group(1) + "/")
    if own != component.package:
        main = binaries.TOOLCHAIN_DIR / component.wrapper / own / "main.go"
        assert "package main" in main.read_text()
    else:
        assert component.package in _tools(go_mod)


def test_node_group_matches_the_real_node_tier() -> None:
    assert binaries.NODE == ("kubelet", "kube-proxy", "coredns")
    assert binaries.cached_dir("kuberay-crds") == binaries.cached_dir("kuberay")


def test_an_unknown_component_is_named_with_the_known_ones() -> None:
    result = subprocess.run(["bash", str(binaries.BUILD_SCRIPT), "--version", "etcdd"], capture_output=True,
                            text=True, check=False)
    assert result.returncode == 2
    assert result.stdout == ""
    assert "unknown component 'etcdd'" in result.stderr and "kube-apiserver" in result.stderr
    with pytest.raises(binaries.MissingBinariesError, match="etcdd"):
        binaries.version.__wrapped__("etcdd")
