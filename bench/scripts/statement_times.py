"""Summarise a server's statement timings: per minute the total, then per statement early against late.

    python bench/scripts/statement_times.py STATS.json [TOP]

STATS.json: {minute: {statement (its first 140 characters): [count, seconds]}}, as the measuring hook in
bench/results/profiles/20261129-scale-30000-server-statements.md writes it. Early is minutes 1-2; late the
last two whole minutes. A statement whose mean time grows with the run reads more rows as the tables grow.
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> None:
    with open(argv[0]) as file:
        stats: dict[str, dict[str, list[float]]] = json.load(file)
    minutes = sorted(stats, key=int)
    for minute in minutes:
        rows = stats[minute].values()
        print(f"minute {minute}: {sum(r[1] for r in rows):.1f} s in {sum(int(r[0]) for r in rows)} statements")
    early = [m for m in minutes if m in ("1", "2")]
    late = minutes[-3:-1] if len(minutes) > 3 else minutes[-1:]

    def summed(minutes_: list[str], key: str) -> tuple[int, float]:
        rows = [stats[m].get(key, [0, 0.0]) for m in minutes_]
        return int(sum(r[0] for r in rows)), sum(r[1] for r in rows)

    table = []
    for key in set().union(*stats.values()):
        (n_early, s_early), (n_late, s_late) = summed(early, key), summed(late, key)
        table.append((s_late, key, n_early, s_early, n_late))
    print(f"early: minutes {', '.join(early)}; late: minutes {', '.join(late)}")
    for s_late, key, n_early, s_early, n_late in sorted(table, reverse=True)[:int(argv[1]) if len(argv) > 1 else 12]:
        mean_early = f"{1000 * s_early / n_early:6.2f}" if n_early else "     -"
        mean_late = f"{1000 * s_late / n_late:6.2f}" if n_late else "     -"
        print(f"{s_late:6.2f} s late | early {n_early:5d} x {mean_early} ms | late {n_late:5d} x {mean_late} ms | {key}")


if __name__ == "__main__":
    main(sys.argv[1:])
