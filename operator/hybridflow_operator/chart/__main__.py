"""Generate the chart's values.schema.json and README.md from the values model.

    python -m hybridflow_operator.chart [--chart DIR] [--check]

`--check` writes nothing and exits 1 naming every file that differs from what the model generates
(`make lint` runs it, next to the CRD check).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hybridflow.api import generated
from hybridflow_operator.chart.readme import render_readme
from hybridflow_operator.chart.schema import render_schema

SCHEMA_FILE = "values.schema.json"
README_FILE = "README.md"


def outputs(chart_dir: Path) -> generated.Outputs:
    """Every file generated from the values model and how to render it."""
    return {chart_dir / SCHEMA_FILE: render_schema, chart_dir / README_FILE: render_readme}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybridflow_operator.chart", description=__doc__.splitlines()[0])
    parser.add_argument("--chart", type=Path, default=Path("charts/hybridflow"),
                        help="Helm chart directory (charts/hybridflow)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if the files are stale")
    args = parser.parse_args(argv)
    return generated.sync(outputs(args.chart), check=args.check, what="chart files", make_target="chart-files")

if __name__ == "__main__":
    sys.exit(main())
