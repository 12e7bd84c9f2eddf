"""Side-by-side benchmarks of hybridflow; `python -m benchmarks.runtime` runs the runtime comparison."""
