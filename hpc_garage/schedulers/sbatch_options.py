"""`hpc-garage sbatch`: read the sbatch options people already type, and map them onto a site request.

Parsing follows sbatch's own getopt rules: `--opt=value` and `--opt value`, `-N2` and `-N 2`, bundled short
flags (`-Qv`), and options stop at the first word that is not one (the script); what follows is the script's.
Long options must be written out in full (sbatch also takes unique prefixes; hpc-garage does not guess).

Three kinds of option:
- modelled: they shape the request that is checked against the site (nodes, GPUs, cores, memory, time,
  partition, account, QOS, job name, log files);
- refused: they contradict what hpc-garage computes (task counts come from the site's worker layout,
  memory is per node, one script per job), and a silent override would surprise; the error says why;
- passed through: everything else (`-C/--constraint`, `--exclusive`, `--mail-type`, `-w`, ...) becomes an
  `#SBATCH` line of the job script rather than an sbatch argument, so the script kept in the run
  directory, `--dry-run` and `show --script` show the whole request, and resubmitting job.sh by hand
  reproduces the job. sbatch treats both alike (the command line would only win a conflict, and a
  passed-through option conflicts with nothing hpc-garage writes).

`-c/--cpus-per-task` keeps sbatch's meaning: a task is a Dask worker, so `-c 4` gives every worker 4 cores
and the job asks for 4 × (workers per node) cores per node. (Reading it as cores per node would make
`-c` mean something sbatch never meant.)
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hpc_garage.core.errors import UserError
from hpc_garage.core.request import Request
from hpc_garage.core.request_options import OPTIONS as REQUEST_OPTIONS

# option -> key of the parsed values: the request options' sbatch spellings (core/request_options.py, keyed by
# their job-variable names), then those of sbatch alone
_VALUED = {spelling: o.name for o in REQUEST_OPTIONS if o.kind != "flag" for spelling in o.sbatch} | {
    "-p": "partition", "--partition": "partition",
    "--gres": "gres",
    "-G": "gpus", "--gpus": "gpus",
    "-c": "cpus_per_task", "--cpus-per-task": "cpus_per_task",
    "-o": "output", "--output": "output",
    "-e": "error", "--error": "error",
}
_FLAGS = {spelling: o.name for o in REQUEST_OPTIONS if o.kind == "flag" for spelling in o.sbatch} | {
    "--dry-run": "dry_run", "-W": "wait", "--wait": "wait", "--parsable": None}  # None: accepted, implied
_REFUSED = {
    "-n": "hpc-garage asks for --ntasks-per-node from the site's worker layout; drop -n/--ntasks",
    "--ntasks": "hpc-garage asks for --ntasks-per-node from the site's worker layout; drop -n/--ntasks",
    "--ntasks-per-node": "hpc-garage sets --ntasks-per-node to the site's workers per node; drop it",
    "--mem-per-cpu": "memory is asked per node here; use --mem",
    "--mem-per-gpu": "memory is asked per node here; use --mem",
    "--cpus-per-gpu": "cores are asked per worker here; use -c/--cpus-per-task",
    "--gpus-per-task": "GPUs are asked per node here; use --gpus-per-node or --gres=gpu:N",
    "-a": "job arrays are not supported: one job runs the whole sweep",
    "--array": "job arrays are not supported: one job runs the whole sweep",
    "--wrap": "hpc-garage runs a Python script; give its path instead of --wrap",
    "-D": "the job runs in the directory you submit from; cd there first",
    "--chdir": "the job runs in the directory you submit from; cd there first",
    "--test-only": "use --dry-run to see the job script without submitting",
}
# sbatch options that take no value (or only an optional `=value`, which getopt never reads from the next word)
_NO_VALUE = {
    "-H", "--hold", "-k", "--no-kill", "-O", "--overcommit", "-Q", "--quiet", "-s", "--oversubscribe", "-v",
    "--verbose", "-I", "--immediate", "--exclusive", "--contiguous", "--ignore-pbs", "--no-requeue", "--requeue",
    "--spread-job", "--use-min-nodes", "--reboot", "--get-user-env", "--nice", "--propagate", "--exact",
}


# every other option sbatch (Slurm 22-24) knows: passed through; anything else is a typo (`--gress`), refused
_SBATCH_LONG = set("""
--acctg-freq --batch --bb --bbf --begin --cluster-constraint --clusters --comment --constraint --container
--container-id --contiguous --core-spec --cores-per-socket --cpu-freq --deadline --delay-boot --dependency
--distribution --exclude --exclusive --export --export-file --extra --extra-node-info --get-user-env --gid
--gpu-bind --gpu-freq --gpus-per-socket --gres-flags --hint --hold --ignore-pbs --immediate --input
--kill-on-invalid-dep --licenses --mail-type --mail-user --mcs-label --mem-bind --mincpus --network --nice
--no-kill --no-requeue --nodefile --nodelist --ntasks-per-core --ntasks-per-gpu --ntasks-per-socket --open-mode
--overcommit --oversubscribe --power --prefer --priority --profile --propagate --quiet --reboot --requeue
--reservation --signal --sockets-per-node --spread-job --switches --thread-spec --threads-per-core --time-min
--tmp --tres-bind --tres-per-task --uid --use-min-nodes --verbose --wait-all-nodes --wckey
""".split())
_SBATCH_SHORT = set("-b -B -C -d -F -H -i -k -L -m -M -O -Q -s -S -v -w -x".split())


@dataclass
class SbatchCall:
    """What an `hpc-garage sbatch` command line asks for, before it meets a site."""

    script: str
    args: tuple[str, ...] = ()
    site: str | None = None
    partition: str | None = None
    nodes: int | None = None
    gpus_per_node: int | None = None
    gpu_type: str | None = None
    cores_per_worker: int | None = None
    memory: int | None = None
    walltime: int | None = None
    account: str | None = None
    qos: str | None = None
    job_name: str | None = None
    container: str | None = None  # hpc-garage's own: the image over the site's (--container)
    output: str | None = None
    error: str | None = None
    passthrough: list[str] = field(default_factory=list)  # directive text, without `#SBATCH`
    dry_run: bool = False
    wait: bool = False
    sweep: str | None = None  # hpc-garage's own: the sweep (core/sweep.py), and whether to resume it
    resume: bool = False

    def request(self) -> Request:
        """What the options ask of the site (`submission.prepare`)."""
        return Request(
            nodes=self.nodes, gpus_per_node=self.gpus_per_node, gpu_type=self.gpu_type,
            cores_per_worker=self.cores_per_worker, memory=self.memory, walltime=self.walltime,
            account=self.account, qos=self.qos, queue=self.partition, job_name=self.job_name,
            container=self.container, extra_directives=tuple(self.passthrough),
        )


def parse(argv: Sequence[str]) -> SbatchCall:
    """sbatch's command line → SbatchCall. Every mistake is one UserError naming the option."""
    values: dict[str, str] = {}
    flags: set[str] = set()
    passthrough: list[str] = []
    words = list(argv)
    i = 0
    while i < len(words):
        word = words[i]
        i += 1
        if word == "--":
            break
        if not word.startswith("-") or word == "-":
            i -= 1
            break
        for option, value, wants_value in _split(word):
            if wants_value and value is None:
                if i >= len(words):
                    raise UserError(f"{option} needs a value")
                value = words[i]
                i += 1
            _take(option, value, values, flags, passthrough)
    rest = words[i:]
    if not rest:
        raise UserError("no script given: hpc-garage sbatch [sbatch options] SCRIPT [ARGS]...")
    call = SbatchCall(script=rest[0], args=tuple(rest[1:]), passthrough=passthrough)
    call.dry_run, call.wait, call.resume = "dry_run" in flags, "wait" in flags, "resume" in flags
    _model(call, values)
    return call


def _split(word: str) -> list[tuple[str, str | None, bool]]:
    """One argv word → (option, attached value or None, takes a value?) for each option in it."""
    if word.startswith("--"):
        name, eq, value = word.partition("=")
        takes = name not in _NO_VALUE and name not in _FLAGS
        if eq and not takes and name in _FLAGS:
            raise UserError(f"{name} takes no value")
        return [(name, value if eq else None, takes and not eq)]
    out = []
    rest = word[1:]
    while rest:
        option, rest = f"-{rest[0]}", rest[1:]
        if option in _NO_VALUE or option in _FLAGS:
            out.append((option, None, False))
            continue
        out.append((option, rest or None, not rest))
        break
    return out


def _take(option: str, value: str | None, values: dict[str, str], flags: set[str], passthrough: list[str]) -> None:
    if option in _REFUSED:
        raise UserError(f"{option}: {_REFUSED[option]}")
    if option in _FLAGS:
        if _FLAGS[option]:
            flags.add(_FLAGS[option])
        return
    if option in _VALUED:
        key = _VALUED[option]
        assert value is not None
        if key in values and values[key] != value:
            raise UserError(f"{option} given twice ({values[key]!r} and {value!r}); give it once")
        values[key] = value
        return
    known = _SBATCH_LONG | _SBATCH_SHORT
    if option not in known:
        import difflib

        every = sorted(known | set(_VALUED) | set(_FLAGS) | set(_REFUSED))
        close = difflib.get_close_matches(option, every, n=1)
        hint = f"did you mean {close[0]}?" if close else "see `man sbatch`"
        raise UserError(f"{option}: not an sbatch option; {hint}")
    passthrough.append(_passthrough(option, value))


def _passthrough(option: str, value: str | None) -> str:
    """An option as an `#SBATCH` line's text; a value with spaces goes in double quotes, as sbatch reads them."""
    if value is None:
        return option
    if re.search(r'[\x00-\x1f\x7f"\\]', value):
        raise UserError(f"{option} {value!r}: a value with quotes, backslashes or control characters cannot be passed on")
    shown = f'"{value}"' if re.search(r"\s", value) or not value else value
    return f"{option}={shown}" if option.startswith("--") else f"{option} {shown}"


def _model(call: SbatchCall, v: dict[str, str]) -> None:
    from hpc_garage.core.units import parse_memory, parse_walltime

    call.site, call.account, call.qos, call.job_name = v.get("site"), v.get("account"), v.get("qos"), v.get("job_name")
    call.output, call.error, call.sweep = v.get("output"), v.get("error"), v.get("sweep")
    call.container = v.get("container")
    if "partition" in v:
        if "," in v["partition"]:
            raise UserError(f"-p {v['partition']}: hpc-garage needs one partition (the site's node shape depends on it)")
        call.partition = v["partition"]
    if "nodes" in v:
        if not re.fullmatch(r"\d+", v["nodes"]):
            raise UserError(f"-N {v['nodes']}: give a fixed node count (the worker layout depends on it), not a range")
        call.nodes = int(v["nodes"])
    if "cpus_per_task" in v:
        call.cores_per_worker = _count(v["cpus_per_task"], "-c/--cpus-per-task")
    if "mem" in v:
        try:
            memory = parse_memory(v["mem"])
        except ValueError as exc:
            raise UserError(f"--mem {v['mem']}: {exc}") from None
        call.memory = memory or None  # sbatch's --mem=0 is "all of the node": the site's default
    if "time" in v:
        try:
            call.walltime = parse_walltime(v["time"])
        except ValueError as exc:
            raise UserError(f"-t/--time {v['time']}: {exc}") from None
    gpu_options = [k for k in ("gres", "gpus", "gpus_per_node") if k in v]
    if len(gpu_options) > 1:
        raise UserError("GPUs given more than once (--gres, -G/--gpus, --gpus-per-node); give them one way")
    if "gres" in v:
        call.gpu_type, call.gpus_per_node = _gres(v["gres"])
    elif "gpus_per_node" in v:
        call.gpu_type, call.gpus_per_node = _typed_count(v["gpus_per_node"], "--gpus-per-node")
    elif "gpus" in v:
        call.gpu_type, total = _typed_count(v["gpus"], "-G/--gpus")
        nodes = call.nodes or 1
        if total % nodes:
            raise UserError(
                f"-G/--gpus {total} over {nodes} nodes is not a whole number per node; use --gpus-per-node"
            )
        call.gpus_per_node = total // nodes


def _gres(spec: str) -> tuple[str | None, int]:
    """`gpu`, `gpu:2`, `gpu:a100:2` (per node, as sbatch reads --gres); other generic resources are refused."""
    parts = spec.split(":")
    if "," in spec or parts[0] != "gpu" or len(parts) > 3:
        raise UserError(
            f"--gres={spec}: hpc-garage understands gpu gres only (gpu, gpu:N, gpu:TYPE:N); "
            "put other generic resources in the site's directives"
        )
    if len(parts) == 1:
        return None, 1
    if len(parts) == 2:
        return (None, _count(parts[1], "--gres")) if parts[1].isdigit() else (parts[1], 1)
    return parts[1], _count(parts[2], "--gres")


def _typed_count(spec: str, option: str) -> tuple[str | None, int]:
    """`N` or `TYPE:N`, as -G and --gpus-per-node take them."""
    kind, _, count = spec.rpartition(":")
    return kind or None, _count(count, option)


def _count(text: str, option: str) -> int:
    if not re.fullmatch(r"\d+", text):
        raise UserError(f"{option} {text}: expected a whole number")
    return int(text)


# --------------------------------------------------------------------------------------- choosing a site


def site_for(call: SbatchCall) -> str:
    """The site named by --site, else the one SLURM site whose queue is the partition (or the default one)."""
    from hpc_garage.sites import find_sites, load_site

    if call.site:
        site = load_site(call.site)
        if site.scheduler != "slurm":
            raise UserError(
                f"site {site.name} is {site.scheduler}, and `hpc-garage sbatch` takes sbatch options; "
                f"use `hpc-garage submit --site {site.name}`"
            )
        if call.partition and site.queue and call.partition != site.queue:
            raise UserError(f"-p {call.partition}: site {site.name} describes partition {site.queue}'s nodes; "
                            f"drop -p, or drop --site to pick the site of partition {call.partition}")
        return call.site
    partition = call.partition or _default_partition()
    by_queue: dict[str, list[str]] = {}
    for name, path in find_sites().items():
        try:
            site = load_site(path)
        except UserError:
            continue
        # sbatch options shape one allocation of the default launch; a dask-mpi or jobqueue site of the same
        # partition is an alternative picked only by --site
        if site.scheduler == "slurm" and site.queue and site.launcher == "mpi" and site.mpi.launch != "dask-mpi":
            by_queue.setdefault(site.queue, []).append(name)
    matches = by_queue.get(partition, [])
    if len(matches) > 1:  # several sites name this partition: keep those shaped like its real nodes
        try:
            shapes = _partition_shapes(partition)
        except UserError:  # sinfo cannot tell them apart (no controller): the choice below is the user's
            shapes = set()
        fitting = [n for n in matches if (load_site(n).node.cores, load_site(n).node.gpus) in shapes]
        matches = fitting if len(fitting) == 1 else matches
    if len(matches) == 1:
        return matches[0]
    given = f"-p {partition}" if call.partition else f"the default partition {partition}"
    if matches:
        raise UserError(f"{given}: {len(matches)} SLURM sites use it ({', '.join(matches)}); pick one with --site NAME")
    known = "; ".join(f"{q}: {', '.join(n)}" for q, n in sorted(by_queue.items())) or "none"
    raise UserError(f"{given}: no SLURM site uses this partition (sites by partition: {known}); pass --site NAME")


def _partition_shapes(partition: str) -> set[tuple[int, int]]:
    """(cores, GPUs) of the partition's nodes, as `sinfo` reports them."""
    import re

    from hpc_garage.schedulers import get

    shapes = set()
    for line in get("slurm").run(["sinfo", "-h", "-p", partition, "-o", "%c|%G"]).split():
        cores, _, gres = line.partition("|")
        gpus = sum(int(m.group(1)) for m in re.finditer(r"gpu(?::[^:,(]+)?:(\d+)", gres))
        if cores.isdigit():
            shapes.add((int(cores), gpus))
    return shapes


def _default_partition() -> str:
    """The partition sbatch would use: the one `sinfo` marks with `*`."""
    from hpc_garage.schedulers import get

    out = get("slurm").run(["sinfo", "-h", "-o", "%P"])
    defaults = [p.rstrip("*") for p in out.split() if p.endswith("*")]
    if not defaults:
        raise UserError("this cluster has no default partition; give -p PARTITION or --site NAME")
    return defaults[0]
