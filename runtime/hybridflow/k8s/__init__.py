"""Kubernetes manifests of an RLTrainingJob, rendered as pure functions, and the contract with its pods.

Imports no kopf, torch or Ray: the CLI (`hybridflow render`) and the operator render the same objects.
"""
