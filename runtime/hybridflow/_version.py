"""The version of hybridflow, written once: pyproject.toml reads it (dynamic version), the package exports it,
the CLI prints it, and the default runtime image is tagged with it. charts/hybridflow/Chart.yaml repeats it
(version and appVersion; docker/build-images.sh tags the images from appVersion) and tests/test_version.py
keeps the two equal."""

__version__ = "0.1.0"
