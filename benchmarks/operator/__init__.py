"""Operator benchmark: N RLTrainingJobs at once on the kwok control plane, against the same RayJobs (and the
objects they need) given straight to KubeRay alone.

`measure` runs the phases and returns raw results, `summarise` turns them into figures (pure), `report` draws
operator.png and fills the operator section of benchmarks/README.md from benchmarks/templates/operator.md.
`python -m benchmarks.operator --help` for the command line.
"""
