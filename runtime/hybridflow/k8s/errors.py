"""Errors in a job that only the operator can see: the CRD schema and CEL rules accept the job,
but it cannot be turned into a cluster (an unknown GPU type, too few GPUs for the graph, ...)."""

from __future__ import annotations


class RenderError(ValueError):
    """`field` is the path users write (spec.cluster.gpuType); `reason` is a CamelCase condition reason."""

    def __init__(self, field: str, reason: str, message: str) -> None:
        self.field = field
        self.reason = reason
        self.message = message
        super().__init__(f"{field}: {message}")
