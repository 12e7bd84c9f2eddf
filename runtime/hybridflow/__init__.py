"""hybridflow: RL post-training of LLMs, declared as a Kubernetes resource and run on Ray."""

from hybridflow._version import __version__
from hybridflow.control import connect
from hybridflow.graph import DataflowGraph, Edge, GraphError, Node

__all__ = ["DataflowGraph", "Edge", "GraphError", "Node", "__version__", "connect"]
