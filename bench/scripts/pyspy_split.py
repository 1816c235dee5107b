"""Split a `py-spy record --format raw` file by thread and innermost frame: where a process's busy time went.

    python bench/scripts/pyspy_split.py RAW [TOP]

Each line of RAW is a stack (frames joined by `;`, outermost first) and its sample count. A sample is
counted under (its thread's entry frame, the innermost frame's package/function); the TOP largest shares
of all samples are printed.
"""

from __future__ import annotations

import re
import sys
from collections import Counter

FRAME = re.compile(r"(.*) \((.*?):\d+\)$")  # "function (path/to/file.py:line)"


def split(lines: list[str]) -> tuple[Counter[tuple[str, str]], int]:
    shares: Counter[tuple[str, str]] = Counter()
    total = 0
    for line in lines:
        stack, _, count = line.rstrip().rpartition(" ")
        if not count.isdigit():
            continue
        frames = stack.split(";")
        found = FRAME.match(frames[-1])
        where = f"{found.group(2).split('site-packages/')[-1].split('/')[0]}/{found.group(1)}" if found else frames[-1]
        shares[(frames[0][:60], where)] += int(count)
        total += int(count)
    return shares, total


def main(argv: list[str]) -> None:
    with open(argv[0]) as raw:
        shares, total = split(raw.readlines())
    print(argv[0], total)
    for key, count in shares.most_common(int(argv[1]) if len(argv) > 1 else 18):
        print(f"  {100 * count / total:5.1f}% {key}")


if __name__ == "__main__":
    main(sys.argv[1:])
