"""The scheduler dashboard: a report file every run writes, and `hybridflow dashboard` serving it live."""

from hybridflow.dashboard.page import render_page, report_path, write_report
from hybridflow.dashboard.view import build_view, step_split

__all__ = ["build_view", "render_page", "report_path", "step_split", "write_report"]
