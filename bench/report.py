"""What a bench run stores: every benchmark's own output, and the pages built from the stored outputs alone.

- `runs/<date>-<time>-<name>.json` and `.md`: one benchmark of one run: its figures, the machine, the load average
  at its start and end, the date and the exact command (`store_run`); written as each benchmark ends, kept;
- `latest.md`/`latest.json`: the last `python -m bench` run, all its benchmarks in one table (`write_reports`);
- `index.md`: every stored run of every benchmark, newest first, with its headline figures (`write_index`): the
  benchmarks page includes it, so every set of runs is shown, not only the one that met its goal.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RUNS_DIR = "runs"


def write_reports(report: dict[str, Any], out: Path) -> tuple[Path, Path]:
    md, js = out / "latest.md", out / "latest.json"
    js.write_text(json.dumps(report, indent=2, default=str) + "\n")
    md.write_text(markdown(report))
    return md, js


def store_run(out: Path, name: str, section: dict[str, Any], machine: dict[str, Any], command: str,
              load_at_end: float | None, runs: int, quick: bool) -> Path:
    """One benchmark's output, with what it was measured on and how, as JSON and as a one-benchmark page."""
    stamp = machine["date"].replace("-", "").replace(":", "").replace(" ", "-")[:15]
    record = {"name": name, "command": command, "date": machine["date"], "runs": runs, "quick": quick,
              "load_average": {"start": round(machine["load_average_at_start"], 2),
                               "end": None if load_at_end is None else round(load_at_end, 2)},
              "machine": machine, "section": section}
    target = out / RUNS_DIR / f"{stamp}-{name}"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.with_suffix(".json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    one = {"machine": machine, "quick": quick, "runs": runs, "seconds": section.get("seconds", 0),
           "benchmarks": {name: section}}
    text = markdown(one).replace("`python -m bench`" + (" --quick" if quick else ""), f"`{command}`", 1)
    target.with_suffix(".md").write_text(text)
    return target.with_suffix(".json")


def write_index(out: Path) -> Path:
    """index.md from every stored run (runs/*.json): newest first per benchmark, each run's load and command."""
    records = []
    for path in sorted((out / RUNS_DIR).glob("*.json")):
        try:
            records.append((path, json.loads(path.read_text())))
        except (OSError, ValueError):
            continue
    lines = ["# Every stored benchmark run", "",
             "Built by `python -m bench` from `bench/results/runs/*.json` alone (each run's own file beside it, "
             "`.md`); newest first. Load average: at the benchmark's start → its end, on "
             "the machine named in its file.", ""]
    for name in sorted({r["name"] for _, r in records}):
        lines += [f"## {name}", "", "| date | command | load | figure | median | ratio to peers | met? |",
                  "|---|---|---|---|---|---|---|"]
        for path, r in sorted(((p, r) for p, r in records if r["name"] == name), key=lambda x: x[1]["date"],
                              reverse=True):
            head = (f"{r['date']} (`runs/{path.stem}.md`)", f"`{r['command']}`",
                    f"{r['load_average']['start']:.1f} → " + ("not recorded" if r["load_average"]["end"] is None
                                                             else f"{r['load_average']['end']:.1f}"))
            ours = [f for f in r["section"].get("figures", []) if f.get("ours")]
            if not ours:
                lines.append("| " + " | ".join([*head, _skip(r["section"]), "", "", ""]) + " |")
            for i, f in enumerate(ours):
                met = {True: "yes", False: "**no**", None: "not judged"}[f.get("met")]
                lines.append("| " + " | ".join([*(head if i == 0 else ("", "", "")), f"{f['group']}: {f['label']}",
                                                _value(f["median"], f["unit"]), _ratios(f) or "–",
                                                met]) + " |")
        lines.append("")
    target = out / "index.md"
    target.write_text("\n".join(lines))
    return target


def markdown(report: dict[str, Any]) -> str:
    m = report["machine"]
    peer_runs = report.get("peer_runs", report["runs"])  # pruning and search: at least 5 (bench/__main__.py)
    peers = f" (pruning and search: {peer_runs})" if peer_runs != report["runs"] else ""
    lines = [
        "# hpc-garage benchmarks" + (" (quick mode: tiny sizes, one run; not figures)" if report["quick"] else ""),
        "",
        f"`{report.get('command') or 'python -m bench' + (' --quick' if report['quick'] else '')}`, {m['date']}, "
        f"{report['seconds']:.0f} s in all. Median of {report['runs']} run(s){peers}, min–max; "
        "ratio = hpc-garage / peer, both measured in this run.",
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
    if name == "search" and section.get("runs"):  # issue 34: each run's pair side by side, at its common best loss
        out += ["", "| run | who | best final loss | common best loss | GPU-s to it | s to it | GPU-s in all | trials "
                "pruned |", "|---|---|---|---|---|---|---|---|"]
        for who, runs in section["runs"].items():
            for r in (r for r in runs if r.get("figures")):
                f = r["figures"]
                cells = [f["best"], f["target"], f["to_target"], f["seconds_to_target"], f["gpu_seconds"]]
                shown = ["–" if v is None else f"{v:.4f}" if i < 2 else f"{v:.1f}" for i, v in enumerate(cells)]
                out.append(f"| {r['run'] + 1} | {who} | " + " | ".join(shown) + f" | {r.get('pruned', '–')} |")
        out.append("")
    if name == "scale" and section.get("rows"):  # issue 32: each size and contender, one line
        out += ["", "| contender | trials | trials/s | per 1,000 at start → end | peak RSS MiB | server CPU/trial |"
                " database on disk | cores busy, first → last tenth |", "|---|---|---|---|---|---|---|---|"]
        for r in section["rows"]:
            if "error" in r:
                out.append(f"| {r['kind']} | {r['n']:,} | failed: {r['error']} | | | | | |")
                continue
            rss = ", ".join(f"{k} {v:,}" for k, v in r["peak_rss_mib"].items())
            server = "–" if r.get("server_cpu_ms_per_trial") is None else f"{r['server_cpu_ms_per_trial']:.1f} ms"
            cores = ", ".join(f"{k} {v}" for k, v in r.get("cores_start_end", {}).items()) or "–"
            disk = "–" if r.get("database_mib") is None else f"{r['database_mib']:,.0f} MiB"
            recorded = f" ({r['trials_per_s_recorded']:.1f} recorded)" if r.get("trials_per_s_recorded") else ""
            out.append(f"| {r['kind']} | {r['n']:,} | {r['trials_per_s']:.1f}{recorded} | "
                       f"{r['per_1000_start_s']} s → "
                       f"{r['per_1000_end_s']} s | {rss} | {server} | {disk} | {cores} |")
        out.append("")
        for r in section["rows"]:
            if ui := r.get("ui"):
                database = {"sqlite": "SQLite"}.get(r.get("database", "sqlite"), r.get("database"))
                out.append(f"- the UI after {r['n']:,} trials (chromium, {database}): " + (
                    f"failed: {ui['error']}" if "error" in ui else
                    f"flow-run page {ui['flow_run_page_s']} s, Task Runs tab {ui['task_runs_tab_s']} s, once the "
                    f"server had caught up ({ui['caught_up_s']} s after the run); `{ui['screenshot']}`"))
    if name == "cli" and section.get("json_bytes"):
        out.append(f"- `show --json` output for the big plan: {section['json_bytes'] / 1e6:.1f} MB")
    return out


def _skip(section: dict[str, Any]) -> str:
    if "figures" in section:
        return "no figure of hpc-garage's"
    return f"skipped: {section['skipped']}" if "skipped" in section else f"failed: {section.get('failed')}"


def _value(v: float | None, unit: str) -> str:
    if v is None:
        return "–"
    if unit == "loss":  # a value of the objective, not a time: 4 decimals, no unit (0.0512, not "51 ms")
        return f"{v:.4f}"
    return f"{v:.1f} {unit}" if unit == "tasks/s" or v >= 10 else f"{v:.2f} {unit}" if v >= 0.1 else f"{v * 1000:.0f} ms"


def _range(f: dict[str, Any]) -> str:
    if f["min"] is None:
        return ("skipped" if f["note"].startswith("skipped") else "failed") if f.get("note") else "–"
    return f"{_value(f['min'], f['unit'])} – {_value(f['max'], f['unit'])}"


def _ratios(f: dict[str, Any]) -> str:
    return "; ".join(f"{r:.2f}× {who}" for who, r in f["ratios"].items())
