"""Runs the commands a page of the docs shows and checks the output it shows: the docs cannot drift from the code.

A tested block is a fenced `console` block right after an HTML comment `<!-- test -->` (or `<!-- test: slurm -->`
for blocks that need the local SLURM). In it, a line `$ COMMAND` is run with bash in one working directory per
page, and the lines after it, up to the next `$ `, are what the page says it prints. Each shown line must appear
in the real output, in order (other lines may come between, as in an abridged transcript), where:

- `…` stands for any text (the page left it out);
- a number is compared exactly (a result, a count, a size), except where it differs from run to run: a
  duration (a number with a unit of time: `7.9 s`, `16s`, `2 min`; a clock `00:20:00`), an id (`job 39`,
  `pid 812`, `runs/39`, a worker `39-n0-gpu0`, a UUID, a hex key like `c8db380d` or a sweep's `-acacab5d07`), a port (`127.0.0.1:35133`) and a date
  (`2026-11-27`, `20261127-213931`): each of those matches any value of its kind;
- `~` at the start of a path matches the home directory's path.

A job id the page shows (`submitted job 39`) is mapped to the one the run got, and later commands that name it
(`hpc-garage status 39`) are run with the real one. A command exits 0 unless its shown output has
`hpc-garage: error:`, then 2.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

MARK = re.compile(r"^<!-- test(?::\s*(?P<needs>[a-z, ]+))? -->\s*$")
NUMBER = r"\d+(?:\.\d+)?"
_HEX = "[0-9a-f]"
_UUID = f"{_HEX}{{8}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{12}}"
# what a shown line may vary in, each with the pattern that matches any value of it; every other number is exact
_VARYING = (
    ("ellipsis", "…", ".*?"),
    ("home", r"^~/|(?<=[\s(])~/", None),
    ("uuid", _UUID, _UUID),
    ("hex", r"(?<![0-9A-Za-z])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{8,32}(?![0-9A-Za-z])", f"{_HEX}{{8,32}}"),
    ("date", r"\d{4}-\d\d-\d\d(?:[T ]\d\d:\d\d(?::\d\d(?:\.\d+)?)?)?|\b\d{8}-\d{6}\b",
     r"(?:\d{4}-\d\d-\d\d(?:[T ]\d\d:\d\d(?::\d\d(?:\.\d+)?)?)?|\d{8}-\d{6})"),
    ("clock", r"\b(?:\d+-)?\d{1,2}:\d\d:\d\d(?:\.\d+)?", r"(?:\d+-)?\d+:\d\d:\d\d(?:\.\d+)?"),
    ("port", r"(?<=[\w\]]):\d{2,5}\b", r":\d+"),
    ("id", r"(?<=\bjob )\d+|(?<=\bjobs )\d+|(?<=\bpid )\d+|(?<=runs/)\d+|\b\d+(?=-n\d)", r"\d+"),
    ("duration", NUMBER + r"(?=\s?(?:µs|ms|s|sec|seconds?|min|minutes?|h|hours?)\b)", NUMBER),
)
_TOKENS = re.compile("|".join(f"(?P<{name}>{regex})" for name, regex, _ in _VARYING))
JOB_WORDS = re.compile(r"\bjobs? (\d+)")
JOB_ARGS = re.compile(r"\b(status|report|logs|cancel|resume|replay) (\d+)\b")


@dataclass
class Step:
    command: str
    shown: list[str]
    line: int  # where the command is on the page

    @property
    def expect_error(self) -> bool:
        return any("hpc-garage: error:" in s for s in self.shown)


@dataclass
class Block:
    needs: set[str]
    steps: list[Step] = field(default_factory=list)


def blocks(page: Path) -> list[Block]:
    """The tested blocks of a page, in order."""
    lines = page.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        mark = MARK.match(lines[i])
        if not mark or i + 1 >= len(lines) or not lines[i + 1].startswith("```console"):
            i += 1
            continue
        block = Block({n.strip() for n in (mark["needs"] or "").split(",") if n.strip()})
        i += 2
        while i < len(lines) and not lines[i].startswith("```"):
            if lines[i].startswith("$ "):
                block.steps.append(Step(lines[i][2:], [], i + 1))
            elif block.steps and lines[i].strip():
                block.steps[-1].shown.append(lines[i])
            i += 1
        found.append(block)
    return found


def pattern(shown: str) -> re.Pattern[str]:
    """A shown line as a pattern: `…` any text, `~/` the home directory, a duration, id, port or date any
    value of its kind, every other character (numbers too) itself."""
    out, last = [], 0
    for m in _TOKENS.finditer(shown):
        out.append(re.escape(shown[last:m.start()]))
        kind = m.lastgroup
        out.append(re.escape(str(Path.home())) + "/" if kind == "home" else dict((n, r) for n, _, r in _VARYING)[kind])
        last = m.end()
    out.append(re.escape(shown[last:]))
    return re.compile("".join(out))


def matches(shown: list[str], actual: list[str]) -> tuple[bool, str, dict[str, str]]:
    """Whether every shown line appears in `actual` in order; the first that does not; job ids shown -> real."""
    jobs: dict[str, str] = {}
    at = 0
    for line in shown:
        if line.strip() == "…":
            continue
        regex = pattern(line.strip())
        while at < len(actual) and not regex.search(actual[at]):
            at += 1
        if at == len(actual):
            return False, line, jobs
        for page_id, real_id in zip(JOB_WORDS.findall(line), JOB_WORDS.findall(actual[at]), strict=False):
            jobs[page_id] = real_id
        at += 1
    return True, "", jobs


def run_page(page: Path, workdir: Path, env: dict[str, str], *, needs: set[str], timeout: float = 600) -> list[str]:
    """Run every tested block of `page` whose needs are in `needs`; returns one line per failure."""
    failures: list[str] = []
    jobs: dict[str, str] = {}
    for block in blocks(page):
        if not block.needs <= needs:
            continue
        for step in block.steps:
            command = JOB_ARGS.sub(lambda m: f"{m[1]} {jobs.get(m[2], m[2])}", step.command)
            done = subprocess.run(["bash", "-c", command], cwd=workdir, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, timeout=timeout)  # one stream: in order
            actual = done.stdout.splitlines()
            want = 2 if step.expect_error else 0
            ok, missing, seen = matches(step.shown, actual)
            jobs.update(seen)
            if done.returncode != want:
                failures.append(f"{page.name}:{step.line}: `{command}` exited {done.returncode}, the page implies "
                                f"{want}; output:\n" + "\n".join(actual[-30:]))
            elif not ok:
                failures.append(f"{page.name}:{step.line}: `{command}` did not print {missing!r}; output:\n"
                                + "\n".join(actual[-30:]))
    return failures

