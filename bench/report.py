"""latest.md (one Markdown table, the machine, and the details behind some figures) and latest.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_reports(report: dict[str, Any], out: Path) -> tuple[Path, Path]:
    md, js = out / "latest.md", out / "latest.json"
    js.write_text(json.dumps(report, indent=2, default=str) + "\n")
    md.write_text(markdown(report))
    return md, js


def markdown(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [
        "# hpc-garage benchmarks" + (" (quick mode: tiny sizes, one run; not figures)" if report["quick"] else ""),
        "",
        f"`python -m bench`{' --quick' if report['quick'] else ''}, {m['date']}, {report['seconds']:.0f} s in all. "
        f"Median of {report['runs']} run(s), min–max; ratio = hpc-garage / peer, both measured in this run.",
        "",
        "| benchmark | who | median | min–max | ratio to peers | goal | met? |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, section in report["benchmarks"].items():
        if "figures" not in section:
            lines.append(f"| {name} | {_skip(section)} | | | | | |")
            continue
        previous = None
        for f in section["figures"]:
            group, previous = ("" if f["group"] == previous else f["group"]), f["group"]
            lines.append("| " + " | ".join([
                group, ("**" + f["label"] + "**") if f["ours"] else f["label"],
                _value(f["median"], f["unit"]), _range(f), _ratios(f), f["goal"] if f["ours"] else "",
                {True: "yes", False: "**no**", None: ""}[f["met"]] if f["ours"] else "",
            ]) + " |")
    lines += ["", "## Details", ""]
    for name, section in report["benchmarks"].items():
        notes = [f"- {f['label']}: {f['note']}" for f in section.get("figures", []) if f.get("note")]
        extra = _extra(name, section)
        if notes or extra:
            lines += [f"**{name}** ({section.get('seconds', 0):.0f} s)", "", *notes, *extra, ""]
    lines += ["## Machine", "", *[f"- {k}: {v}" for k, v in m.items()], ""]
    return "\n".join(lines)


def _extra(name: str, section: dict[str, Any]) -> list[str]:
    out = []
    if section.get("phases"):  # where the wall time went, measured or not (summed over runs)
        out.append("- wall time by phase: " + ", ".join(f"{k} {v:.0f} s" for k, v in section["phases"].items()))
    if name == "overhead":
        for who, cpu in section.get("cpu_ms_per_task", {}).items():
            parts = ", ".join(f"{k} {v:g}" for k, v in cpu.items())
            out.append(f"- CPU ms per task, {who}: {parts} (median)")
        recorded = section.get("recorded_in_api") or []
        if recorded:
            shown = ", ".join(f"{r['completed']}/{r['submitted']}" for r in recorded)
            out.append(f"- hpc-garage's task runs read back from Prefect's API as each flow returned, COMPLETED: {shown}")
    if name == "scaling":
        for mode, m in section.get("models", {}).items():
            out.append(f"- {mode}: scheduler CPU per registered worker {m['cpu_per_worker_slope_s'] * 1000:.2f} ms (slope of "
                       f"{m['points']} runs), first worker {m['first_worker_s']:.1f} s after the job started; model for "
                       f"32,768 workers: {m['predicted_s']:.0f} s; workers registered by 180 s: {m['workers_by_180_s']:,.0f}")
        for mode, runs in section.get("runs", {}).items():
            for r in runs:
                if "error" in r:
                    out.append(f"- {mode}, {r['nodes']} nodes: failed: {r['error']}")
                else:
                    out.append(f"- {mode}, {r['nodes']} nodes x {r['workers'] // r['nodes']} workers: registered "
                               f"{r['registered']:.1f} s, first worker {r['first_worker']:.1f} s, window {r['window']:.1f} s "
                               f"using {r['window_cpu']:.2f} s of the scheduler's main thread, load {r['load']:.1f}")
    if name == "packing" and section.get("plot"):
        out.append(f"- per-GPU timeline of each layout's last sweep: `{section['plot']}`")
    if name == "pruning" and section.get("rows"):  # issue 25: each sweep's figures side by side
        out += ["", "| sweep | GPU-seconds | makespan | pruned | steps a pruned trial ran (mean) | best trial |",
                "|---|---|---|---|---|---|"]
        for who, row in section["rows"].items():
            best = ", ".join(map(str, row["best"])) + ("" if row["same_best"] else
                                                         f" (**not** {section.get('expected_best')})")
            steps = "–" if row.get("pruned_steps") is None else f"{row['pruned_steps']:g}"
            out.append(f"| {who} | {row['gpu_seconds']:.1f} s | {row['makespan']:.1f} s | {row['pruned']:g} | {steps} "
                       f"| {best} |")
        out.append("")
        out.append(f"- best trial of the full curves: {section.get('expected_best')}; GPU-seconds = each trial's "
                   "duration x its 1 GPU, summed; makespan = first trial's start to last trial's end (median of runs)")
    if name == "cli" and section.get("json_bytes"):
        out.append(f"- `show --json` output for the big plan: {section['json_bytes'] / 1e6:.1f} MB")
    return out


def _skip(section: dict[str, Any]) -> str:
    return f"skipped: {section['skipped']}" if "skipped" in section else f"failed: {section.get('failed')}"


def _value(v: float | None, unit: str) -> str:
    if v is None:
        return "–"
    return f"{v:.1f} {unit}" if unit == "tasks/s" or v >= 10 else f"{v:.2f} {unit}" if v >= 0.1 else f"{v * 1000:.0f} ms"


def _range(f: dict[str, Any]) -> str:
    if f["min"] is None:
        return ("skipped" if f["note"].startswith("skipped") else "failed") if f.get("note") else "–"
    return f"{_value(f['min'], f['unit'])} – {_value(f['max'], f['unit'])}"


def _ratios(f: dict[str, Any]) -> str:
    return "; ".join(f"{r:.2f}× {who}" for who, r in f["ratios"].items())
