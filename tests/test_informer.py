"""The informer's pure parts: where it lists, what it keeps of an object, what a new list says was deleted,
and how a watch stream is cut into events. The list-and-watch itself runs against a real API server in
e2e/test_list_watch.py."""

from __future__ import annotations

import json

import pytest

from hybridflow_operator.machinery.client import JsonLines
from hybridflow_operator.machinery.informer import Source, collection_path, stub, vanished


@pytest.mark.parametrize(("api_version", "plural", "namespace", "path"), [
    ("v1", "pods", None, "/api/v1/pods"),
    ("v1", "pods", "team-a", "/api/v1/namespaces/team-a/pods"),
    ("ray.io/v1", "rayjobs", None, "/apis/ray.io/v1/rayjobs"),
    ("ray.io/v1", "rayjobs", "team-a", "/apis/ray.io/v1/namespaces/team-a/rayjobs"),
])
def test_collection_paths(api_version: str, plural: str, namespace: str | None, path: str) -> None:
    assert collection_path(api_version, plural, namespace) == path


def test_a_source_sends_only_the_selectors_it_has() -> None:
    assert Source("/api/v1/pods", "Pod", "hybridflow.io/job", "spec.nodeName=").params == {
        "labelSelector": "hybridflow.io/job", "fieldSelector": "spec.nodeName="}
    assert Source("/apis/ray.io/v1/rayjobs", "RayJob", "hybridflow.io/job").params == {
        "labelSelector": "hybridflow.io/job"}


def test_the_stub_keeps_identity_and_owners_only() -> None:
    pod = {"apiVersion": "v1", "kind": "Pod", "spec": {"containers": []}, "status": {"phase": "Pending"},
           "metadata": {"name": "p", "namespace": "ns", "uid": "u1", "labels": {"a": "b"}, "resourceVersion": "9",
                        "ownerReferences": [{"kind": "RayCluster", "name": "c"}], "managedFields": [{}]}}
    assert stub(pod) == {"apiVersion": "v1", "kind": "Pod",
                         "metadata": {"name": "p", "namespace": "ns", "uid": "u1", "labels": {"a": "b"},
                                      "ownerReferences": [{"kind": "RayCluster", "name": "c"}]}}


def test_a_new_list_reports_what_went_missing_meanwhile() -> None:
    known = {("ns", "a"): {"metadata": {"name": "a"}}, ("ns", "b"): {"metadata": {"name": "b"}},
             ("other", "a"): {"metadata": {"name": "a", "namespace": "other"}}}
    assert vanished(known, [("ns", "a"), ("ns", "c")]) == [known[("ns", "b")], known[("other", "a")]]
    assert vanished(known, list(known)) == []
    assert vanished({}, [("ns", "a")]) == []


def test_watch_lines_split_across_chunks_and_several_in_one() -> None:
    events = [{"type": "ADDED", "object": {"metadata": {"name": f"p{i}"}, "data": "x" * 5000}} for i in range(3)]
    stream = b"".join(json.dumps(e).encode() + b"\n" for e in events) + b"\n"  # and an empty line
    lines = JsonLines()
    seen = []
    for i in range(0, len(stream), 4096):  # a line longer than a chunk, chunks ending mid-line
        seen.extend(lines.feed(stream[i:i + 4096]))
    assert seen == events
    assert lines.feed(b'{"type": "DELETED", "object": {}}') == []  # no newline yet: the line is not complete
    assert lines.feed(b"\n") == [{"type": "DELETED", "object": {}}]
