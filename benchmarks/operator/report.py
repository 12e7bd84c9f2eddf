"""Operator benchmark, figures -> operator.png and the operator section of benchmarks/README.md.

The prose is in benchmarks/templates/operator.md; this module picks the sections that apply, fills in the
figures and re-wraps the paragraphs.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import Text
from benchmarks.operator.summarise import (
    TARGETS,
    headline_value,
    other_runs,
    request_groups,
    run_summary,
)
from hybridflow.metrics import pyplot

ROOT = Path(__file__).resolve().parents[2]
BEGIN, END = "<!-- operator-bench:start -->", "<!-- operator-bench:end -->"
WRAP = 112
KEEP = "\x00"  # a space that textwrap does not break at
MARKUP_START = re.compile(r"\s*([-+*>#]|\d+[.)])(\s|$)")
CPU_COLUMNS = (("kube-apiserver", "API server"), ("etcd", "etcd"), ("kuberay-operator", "KubeRay"),
               ("kube-scheduler", "scheduler"), ("kube-controller-manager", "controller-manager"), ("kwok", "kwok"),
               ("operator", "hybridflow operator"), ("benchmark", "benchmark"), ("other", "other processes"))
STAGES = ("react", "apply")
BEFORE_AFTER_ROWS = (
    ("apply→RayJob p50 / p99", lambda r: f"{fmt(r['apply_to_rayjob_s'].get('p50'), '', 3)} / "
                                         f"{fmt(r['apply_to_rayjob_s'].get('p99'), ' s', 3)}"),
    ("every RayJob exists", lambda r: fmt(r.get("every_rayjob_exists_s"), " s", 1)),
    ("all pods bound (KubeRay alone)", lambda r: f"{fmt(r.get('pods_bound_s'), ' s', 1)} "
                                                 f"({fmt(r.get('kuberay_alone_pods_bound_s'), ' s', 1)})"),
    ("ratio", lambda r: fmt(r.get("pods_bound_overhead_ratio"), "", 3)),
    ("API requests per job (until bound / until quiet)",
     lambda r: f"{fmt(r.get('api_requests_per_job_until_pods_bound'), '', 1)} / "
               f"{fmt(r.get('api_requests_per_job_until_quiet'), '', 1)}"),
    ("operator peak RSS", lambda r: fmt(r.get("operator_peak_rss_mb"), " MB", 1)),
    ("operator CPU s", lambda r: fmt(r.get("operator_cpu_s"), "", 1)),
    ("other processes' CPU s", lambda r: fmt(r.get("machine_other_cpu_s"), "", 0)),
)


def fmt(value: Any, unit: str = "", digits: int = 2) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.{digits}f}{unit}"
    return f"{value}{unit}"


def p50_p99(summary: Mapping[str, Any]) -> str:
    return f"{fmt(summary.get('p50'))} / {fmt(summary.get('p99'))} s"


def and_list(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def setting(doc: Mapping[str, Any], key: str, unit: str = "") -> str:
    return f"{doc['environment']['operator_settings'][key]:g}{unit}"


def short_path(line: str) -> str:
    """A trace line without the interpreter's and the checkout's directories, and without `:0` line numbers."""
    line = re.sub(r"/\S*/(?:site-packages|lib/python3\.\d+)/", "", line)
    line = line.replace(str(ROOT) + "/", "")
    return re.sub(r"(\.py):0\b", r"\1", line)


# -- the README section -------------------------------------------------------------------------------------


def readme_block(doc: Mapping[str, Any], text: Text | None = None) -> str:
    """The operator section of benchmarks/README.md, markers included, from a summarised run."""
    text = text or Text("operator.md")
    env = doc["environment"]
    sizes = doc["sizes"]
    rows = []
    for n, size in sizes.items():
        ours, alone = size["hybridflow"], size["kuberay_alone"]
        lat = ours["apply_to_rayjob_s"]
        rows.append(
            f"| {n} | {fmt(ours['every_rayjob_exists_s'], ' s', 1)} "
            f"| {fmt(lat['p50'])} / {fmt(lat['p95'])} / {fmt(lat['p99'])} s "
            f"| {fmt(ours['pods_bound_s'], ' s', 1)} | {fmt(alone['pods_bound_s'], ' s', 1)} "
            f"| **{fmt(size['pods_bound_overhead_ratio'], '', 2)}** "
            f"| {fmt(ours['operator_peak_rss_mb'], ' MB', 0)} "
            f"| {fmt(ours['api_requests']['per_job_until_pods_bound'], '', 1)} / "
            f"{fmt(ours['api_requests']['per_job_until_quiet'], '', 1)} |"
        )
    others = other_runs(doc)
    before = (doc.get("previous_design") or {}).get("sizes") or {}
    checks = []
    for key, v in doc["targets"].items():
        previous = headline_value(before, key)
        seen = [x for x in (headline_value(summary, key) for summary in others.values()) if x is not None]
        checks.append(text(
            "check", key=key, measured=fmt(v["measured"], "", 3), target=v["target_at_most"],
            verdict="not run" if v["met"] is None else ("met" if v["met"] else "**missed**"),
            previous=text("check_previous", value=fmt(previous, "", 3)) if previous is not None else "",
            others=text("check_others", values=", ".join(fmt(x, "", 2) for x in seen)) if seen else ""))
    phases = [phase for size in sizes.values() for phase in (size["hybridflow"], size["kuberay_alone"])]
    gaps = [abs(phase[f"{k}_s"] - phase[f"{k}_server_s"]) for phase in phases
            for k in ("every_rayjob_exists", "pods_bound")
            if phase.get(f"{k}_s") is not None and phase.get(f"{k}_server_s") is not None]
    watch_lower = all(
        (watch := (size["hybridflow"].get("apply_to_rayjob_watch_s") or {}).get("p50")) is not None
        and (server := size["hybridflow"]["apply_to_rayjob_s"].get("p50")) is not None and watch < server
        for size in sizes.values())
    kuberay = env["components"].get("kuberay")
    body = text(
        "readme", kuberay=f" {kuberay}" if kuberay else "", machine=env["machine"], rows="\n".join(rows),
        repeat_notes="".join(repeat_note(text, n, size["repeats"]) for n, size in sizes.items() if size.get("repeats")),
        checks="\n".join(checks), agree=text("agree", ms=f"{max(gaps) * 1000:.0f}") if gaps else "",
        watch_lower=text("watch_lower") if watch_lower else "", apply_threads=env["apply_threads"],
        cpus=env["machine"].split(", ")[1], every=text("every_run_below" if others else "every_run_none"),
        run_minutes=fmt(env["run_s"] / 60, " min", 0), fleet_nodes=env["fleet_nodes"], findings=findings(doc, text))
    return reflow(f"{BEGIN}\n{body}\n{END}")


def repeat_note(text: Text, n: str, repeats: Sequence[Mapping[str, Any]]) -> str:
    ours_first = sum(1 for r in repeats if r["first"] == "hybridflow")
    order = (text("order_alternating", alone_first=len(repeats) - ours_first, ours_first=ours_first)
             if ours_first else text("order_one_way"))
    ratios = ", ".join(fmt(r["pods_bound_overhead_ratio"], "", 2) for r in repeats)
    return text("repeat_note", n=n, count=len(repeats), order=order, ratios=ratios)


def findings(doc: Mapping[str, Any], text: Text) -> str:
    """Where the time, the requests and the memory go, from the measurements."""
    sizes = list(doc["sizes"])
    small, big = sizes[0], sizes[-1]
    ours = {n: doc["sizes"][n]["hybridflow"] for n in sizes}
    alone = {n: doc["sizes"][n]["kuberay_alone"] for n in sizes}
    stages = [k for k in STAGES if all(k in ours[n]["apply_to_rayjob_stages_s"] for n in sizes)]
    stage_rows = [f"| {text('stage_' + k)} | "
                  + " | ".join(p50_p99(ours[n]["apply_to_rayjob_stages_s"][k]) for n in sizes) + " |" for k in stages]
    stage_rows.append(f"| {text('stage_total')} | " + " | ".join(p50_p99(ours[n]["apply_to_rayjob_s"]) for n in sizes)
                      + " |")
    p99 = {n: {k: ours[n]["apply_to_rayjob_stages_s"][k]["p99"] or 0 for k in stages} for n in sizes}
    worst = {n: max(p99[n], key=p99[n].__getitem__) for n in sizes} if stages else {}
    largest = ""
    if worst and len(set(worst.values())) == 1:
        largest = text("largest_one", stage=worst[small], where=f"N = {small}" if len(sizes) == 1 else "every N")
    elif worst:
        largest = text("largest_each", stages=and_list([f"**{worst[n]}** at N = {n}" for n in sizes]))

    def exists(phase: Mapping[str, Any], n: str) -> str:
        return fmt(phase[n].get("every_rayjob_exists_s"), " s", 1)

    baseline = ""
    if any(alone[n].get("every_rayjob_exists_s") is not None for n in sizes):
        baseline = text("baseline", times=and_list([exists(alone, n) for n in sizes]))
    requests = {n: ours[n]["api_requests"] for n in sizes}
    by_kind = requests[big]["per_job_by_kind_until_quiet"]
    big_cpu, alone_cpu = ours[big].get("cpu_s") or {}, alone[big].get("cpu_s") or {}
    cpu_line = ""
    if big_cpu.get("operator") is not None:
        cpu_line = text(
            "cpu_line", n=big, operator=fmt(big_cpu["operator"], " CPU s", 1),
            window=fmt(ours[big].get("window_s"), " s", 0), apiserver=fmt(big_cpu.get("kube-apiserver"), " CPU s", 0),
            alone=text("cpu_line_alone", apiserver=fmt(alone_cpu.get("kube-apiserver"), " CPU s", 0),
                       window=fmt(alone[big].get("window_s"), " s", 0)) if alone_cpu else "") + " "
    cpu_rows = []
    for n in sizes:
        for name, result in (("KubeRay alone", alone[n]), ("hybridflow", ours[n])):
            cpu = result.get("cpu_s") or {}
            if cpu:
                cells = " | ".join(fmt(cpu.get(k), "", 0) if k in cpu else "—" for k, _ in CPU_COLUMNS)
                cpu_rows.append(f"| {n} | {name} | {fmt(result.get('window_s'), '', 0)} | {cells} |")
    out = text(
        "findings", sizes_head=" | ".join(f"N = {n}" for n in sizes), sizes_sep="---|" * len(sizes),
        stage_rows="\n".join(stage_rows), largest=largest + " " if largest else "",
        max_requests=setting(doc, "max_requests"),
        rayjobs_exist=and_list([f"{exists(ours, n)} (N = {n})" for n in sizes]), baseline=baseline,
        requests=and_list([f"{fmt(requests[n]['per_job_until_pods_bound'], '', 1)} / "
                           f"{fmt(requests[n]['per_job_until_quiet'], '', 1)} at N = {n}" for n in sizes]),
        big=big, groups=and_list([f"{v:g} {k}" for k, v in request_groups(by_kind).items() if v or k != "other"]),
        kinds=", ".join(f"`{k}` {v:g}" for k, v in list(by_kind.items())[:5]),
        status_min_interval=setting(doc, "status_min_interval", " s"),
        status_writes_per_s=setting(doc, "status_writes_per_s"), cpu_line=cpu_line,
        cpu_labels=" | ".join(label for _, label in CPU_COLUMNS), cpu_sep="---|" * (3 + len(CPU_COLUMNS)),
        cpu_rows="\n".join(cpu_rows))
    return out + "\n" + memory(doc, text) + traces(doc, text) + every_run(doc, text) + what_changed(doc, text)


def memory(doc: Mapping[str, Any], text: Text) -> str:
    """The operator's RSS: idle, at its peak, and at the end of the measured window."""
    parts, stays = [], []
    for n, size in doc["sizes"].items():
        ours = size["hybridflow"]
        idle, peak = ours.get("operator_rss_idle_mb"), ours.get("operator_peak_rss_mb")
        series = ours.get("rss_series") or []
        per_job = ""
        if idle is not None and peak is not None:
            end = text("memory_end", mb=f"{series[-1][1]:.0f}") if series else ""
            per_job = text("memory_per_job", kb=f"{(peak - idle) * 1024 / int(n):.0f}", end=end)
            stays.append(bool(series) and series[-1][1] >= idle + 0.9 * (peak - idle))
        parts.append(text("memory_size", idle=fmt(idle, " MB", 0), peak=fmt(peak, " MB", 0), n=n, per_job=per_job))
    return text("memory", sizes=and_list(parts), stays_high=text("memory_stays_high") if stays and all(stays) else "")


def traces(doc: Mapping[str, Any], text: Text) -> str:
    """The memory traces of attached `--trace-memory` runs."""
    out = ""
    for name, runs in (doc.get("what_if") or {}).items():
        trace = next((r["tracemalloc"] for r in runs.values() if r.get("tracemalloc")), None)
        if trace:
            start = next((i for i, line in enumerate(trace) if line.startswith("by call path")), len(trace))
            excerpt = [short_path(line) for line in [*trace[:9], "  ...", "", *trace[start:start + 6]]]
            out += text("trace", name=name, excerpt="\n".join(excerpt))
    return out


def every_run(doc: Mapping[str, Any], text: Text) -> str:
    """One table of this run and the other runs attached to it."""
    runs: dict[str, Mapping[str, Any]] = {text("every_run_this"): run_summary(doc), **other_runs(doc)}
    if len(runs) < 2:
        return ""

    def median_of(r: Mapping[str, Any]) -> str:
        ratios = r.get("repeat_ratios") or []
        return text("every_run_median", ratios=", ".join(fmt(x) for x in ratios)) if len(ratios) > 1 else ""

    rows = [
        f"| {name} | {n} | {p50_p99(r['apply_to_rayjob_s'])} | {fmt(r['every_rayjob_exists_s'], ' s', 0)} "
        f"| {fmt(r['pods_bound_s'], ' s', 0)} | {fmt(r.get('kuberay_alone_pods_bound_s'), ' s', 0)} "
        f"| {fmt(r.get('pods_bound_overhead_ratio'))}{median_of(r)} | {fmt(r['operator_peak_rss_mb'], ' MB', 0)} "
        f"| {fmt(r.get('api_requests_per_job_until_quiet'), '', 1)} "
        f"| {fmt(r.get('kuberay_alone_other_cpu_s'), '', 0)} / {fmt(r['machine_other_cpu_s'], '', 0)} |"
        for name, summary in runs.items()
        for n, r in summary.items()
    ]
    return text("every_run", rows="\n".join(rows))


def what_changed(doc: Mapping[str, Any], text: Text) -> str:
    return text("what_changed", status_min_interval=setting(doc, "status_min_interval", " s"),
                max_requests=setting(doc, "max_requests"), status_writes_per_s=setting(doc, "status_writes_per_s"),
                spin_up_jobs=setting(doc, "spin_up_jobs"), status_interval=setting(doc, "status_interval", " s"),
                before_after=before_after(doc, text))


def before_after(doc: Mapping[str, Any], text: Text) -> str:
    """The previous design's figures against this run's, when the document has them."""
    before = doc.get("previous_design")
    if not before:
        return ""
    now = run_summary(doc)
    then = {n: before["sizes"].get(n) or {"apply_to_rayjob_s": {}} for n in now}
    rows = [f"| {label} | " + " | ".join(f"{cell(then[n])} | {cell(now[n])}" for n in now) + " |"
            for label, cell in BEFORE_AFTER_ROWS]
    commit, machine = before.get("git_commit_at_start"), before.get("machine")
    return text("before_after", design=before["design"], rows="\n".join(rows),
                commit=text("before_after_commit", commit=commit) if commit else "",
                where=text("before_after_where", machine=machine) if machine else "",
                sizes_head=" | ".join(f"N = {n}: before | now" for n in now), sizes_sep="---|---|" * len(now))


def reflow(markdown: str, width: int = WRAP) -> str:
    """Prose paragraphs and list items re-wrapped (figures filled in make their lines uneven); tables,
    headings, comments and code blocks stay as they are."""
    out: list[str] = []
    item: list[str] = []  # the paragraph or list item being collected
    fenced = False

    def flush() -> None:
        if item:
            bullet = re.match(r"(- |\d+\. )", item[0])
            indent = " " * len(bullet.group(1)) if bullet else ""
            words = " ".join(line.strip() for line in item)
            # code spans, "N = 100" and "a / b" stay on one line
            words = re.sub(r"`[^`]*`|\bN = \d+|\S+ / \S+", lambda m: m.group(0).replace(" ", KEEP), words)
            lines = [line.replace(KEEP, " ") for line in textwrap.wrap(
                words, width, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)]
            for i in range(1, len(lines)):  # a line must not open a list, quote or heading of its own
                while MARKUP_START.match(lines[i]) and " " in lines[i - 1].strip():
                    head, _, last = lines[i - 1].rpartition(" ")
                    lines[i - 1], lines[i] = head, f"{indent}{last} {lines[i].strip()}"
            out.extend(lines)
            item.clear()

    for line in markdown.splitlines():
        if line.startswith("```"):
            flush()
            fenced = not fenced
            out.append(line)
        elif fenced or not line.strip() or line.startswith(("|", "#", "<!--")):
            flush()
            out.append(line)
        elif re.match(r"(- |\d+\. )", line):
            flush()
            item.append(line)
        else:
            item.append(line)
    flush()
    return "\n".join(out) + ("\n" if markdown.endswith("\n") else "")


# -- the plot -----------------------------------------------------------------------------------------------


def plot(doc: Mapping[str, Any], path: Path) -> None:
    """Apply-to-RayJob CDF, time until every pod is bound, the operator's RSS over time."""
    plt = pyplot()

    sizes = list(doc["sizes"])
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    ax = axes[0]
    for n in sizes:
        samples = doc["sizes"][n]["hybridflow"]["apply_to_rayjob_samples_s"]
        if samples:
            ax.plot(samples, [(i + 1) / len(samples) for i in range(len(samples))], label=f"N = {n}")
    ax.axvline(TARGETS["n100.p99_apply_to_rayjob_s"], color="grey", ls="--", lw=1, label="target p99 (N = 100)")
    ax.set(xlabel="apply → RayJob (s)", ylabel="fraction of jobs", title="Apply-to-RayJob latency (CDF)")
    ax.legend()
    ax = axes[1]
    width = 0.38
    xs = range(len(sizes))
    ours = [doc["sizes"][n]["hybridflow"]["pods_bound_s"] or 0 for n in sizes]
    alone = [doc["sizes"][n]["kuberay_alone"]["pods_bound_s"] or 0 for n in sizes]
    ax.bar([x - width / 2 for x in xs], alone, width, label="KubeRay alone", color="tab:grey")
    bars = ax.bar([x + width / 2 for x in xs], ours, width, label="hybridflow + KubeRay", color="tab:blue")
    for bar, n in zip(bars, sizes, strict=True):
        ratio = doc["sizes"][n]["pods_bound_overhead_ratio"]
        ax.annotate(f"x{ratio:.2f}" if ratio else "—", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom")
    ax.set_xticks(list(xs), [f"N = {n}" for n in sizes])
    ax.set(ylabel="seconds from first apply", title="Time until every Ray pod is bound")
    ax.legend()
    ax = axes[2]
    for n in sizes:
        series = [p for p in doc["sizes"][n]["hybridflow"].get("rss_series") or [] if p[0] >= 0]
        if series:
            ax.plot([p[0] for p in series], [p[1] for p in series], label=f"N = {n}")
    ax.axhline(TARGETS["n500.operator_peak_rss_mb"], color="grey", ls="--", lw=1, label="target (N = 500)")
    ax.set(xlabel="seconds from first apply", ylabel="MB", title="Operator RSS")
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
