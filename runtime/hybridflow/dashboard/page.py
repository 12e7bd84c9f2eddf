"""The dashboard's one HTML page: the view model inlined as JSON, the script and styles inlined from the
package's assets, so the same page works as a file (the run's report.html) and served live."""

from __future__ import annotations

import html
import json
import os
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from hybridflow.dashboard.view import build_view

REPORT_NAME = "report.html"


@cache
def asset(name: str) -> str:
    """A file of hybridflow/dashboard/assets (package data: nothing is fetched at run time)."""
    return (resources.files("hybridflow.dashboard") / "assets" / name).read_text(encoding="utf-8")


def render_page(view: dict[str, Any], live_url: str | None = None, refresh_s: float = 2.0) -> str:
    """The page for `view`; with `live_url` its script fetches a new view from there every `refresh_s`."""
    data = json.dumps(view, allow_nan=False, separators=(",", ":")).replace("</", "<\\/")
    config = json.dumps({"live": live_url, "refresh_ms": int(refresh_s * 1000)})
    return (asset("page.html")
            .replace("{{title}}", html.escape(str(view.get("title", "hybridflow"))))
            .replace("{{style}}", asset("dashboard.css"))
            .replace("{{config}}", config)
            .replace("{{script}}", asset("dashboard.js"))
            .replace("{{data}}", data))


def report_path(metrics_path: str | Path) -> Path:
    """Where a run's report goes: beside its metrics file (and its metrics.png)."""
    return Path(metrics_path).with_name(REPORT_NAME)


def write_report(records: list[dict[str, Any]], status: dict[str, Any] | None, out: str | Path,
                 title: str = "") -> Path:
    """The self-contained report of a run; written to a temporary name first, so a reader never sees half."""
    out = Path(out)
    text = render_page(build_view(records, status, title))
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, out)
    return out
