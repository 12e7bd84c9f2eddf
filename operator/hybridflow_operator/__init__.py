"""The hybridflow operator: reconciles RLTrainingJobs into KubeRay RayJobs. Run it as `hybridflow-operator`."""

from hybridflow._version import __version__

__all__ = ["__version__"]
