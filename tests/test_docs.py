"""The docs site and the README are kept true: the site builds strictly, its generated reference is current, the
README is a front page that links every part, and the tutorial's commands print what the tutorial shows."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.doc_commands import blocks, matches, pattern, run_page

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PARTS = ("tutorial/", "how-to/", "reference/", "explanation/", "benchmarks.md")


def test_generated_reference_pages_are_current() -> None:
    done = subprocess.run([sys.executable, "scripts/docs_gen.py", "--check"], cwd=ROOT, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr


def _mkdocs() -> None:
    """mkdocs comes with the test extra: under CI its absence is a failure, not a skip."""
    try:
        import mkdocs  # noqa: F401
    except ImportError:
        if os.environ.get("CI") == "true":
            pytest.fail("mkdocs is not installed: the test extra brings it (pip install -e '.[test]')")
        pytest.skip("mkdocs is not installed: pip install -e '.[docs]'")


def test_the_site_builds_strictly_with_its_four_parts_and_benchmarks(tmp_path: Path) -> None:
    _mkdocs()
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    # the offline plugin writes page.html, not page/index.html, so the site reads from file:// too
    for page in ("tutorial/index.html", "how-to/index.html", "reference/index.html", "explanation/index.html",
                 "benchmarks.html", "reference/cli.html", "reference/api.html"):
        assert (site / page).is_file(), page
    # generated from click: every command is on the CLI page
    from click import Group

    from hpc_garage import cli

    group = next(v for v in vars(cli).values() if isinstance(v, Group))
    cli_page = (site / "reference/cli.html").read_text()
    for name in group.list_commands(None):  # type: ignore[arg-type]
        assert f"hpc-garage {name}" in cli_page, name
    # offline: no page asks a font or script from the internet
    index = (site / "index.html").read_text()
    assert "fonts.googleapis.com" not in index


def test_readme_is_a_front_page_that_links_every_part_of_the_docs() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 210
    links = re.findall(r"\]\((docs/[^)#]+)", readme)
    for part in PARTS:
        assert any(link.startswith(f"docs/{part}") for link in links), part
    for link in links:
        assert (ROOT / link).exists(), link
    # no measurement logs: dates of runs and load averages live in the benchmarks page
    assert not re.search(r"load average|Measured 20\d\d|\(20\d\d-\d\d-\d\d", readme)


def test_every_page_in_the_nav_exists_and_every_page_is_in_the_nav() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    listed = set(re.findall(r"([\w./-]+\.md)", nav))
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    assert listed == pages, (sorted(listed - pages), sorted(pages - listed))


# ---- the harness itself --------------------------------------------------------------------------------------

def test_shown_output_matches_with_numbers_and_ellipses_free(tmp_path: Path) -> None:
    assert pattern("submitted job 39 (site lab-gpu)").search("submitted job 112 (site lab-gpu)")
    assert not pattern("submitted job 39 (site lab-gpu)").search("submitted job 112 (site lab-cpu)")
    assert pattern("job 39 done | sweep: …").search("job 7 done | sweep: 8 done, 0 running")
    ok, missing, jobs = matches(["submitted job 39 (site s)", "job 39 done"],
                                ["noise", "submitted job 5 (site s)", "job 5 running", "job 5 done"])
    assert ok and jobs == {"39": "5"}
    ok, missing, _ = matches(["job 39 done", "submitted job 39"], ["submitted job 5", "job 5 done"])
    assert not ok and missing == "submitted job 39"  # order counts


def test_results_and_counts_are_compared_exactly_and_only_durations_ids_ports_and_dates_vary() -> None:
    line = "sweep: 4 experiments on 2 workers, result 0.33 (expected 0.33), first task 15.6 s after start"
    assert pattern(line).search(line.replace("15.6 s", "3 s"))
    for wrong in ("result 0.34 (expected 0.33)", "result 0.33 (expected 0.34)", "result 0.330 (expected 0.33)"):
        assert not pattern(line).search(line.replace("result 0.33 (expected 0.33)", wrong)), wrong
    assert not pattern(line).search(line.replace("4 experiments on 2", "4 experiments on 3"))
    assert not pattern("5 trials (5 done, 0 failed)").search("5 trials (4 done, 1 failed)")
    varying = {  # shown -> another run's line
        "registered in 7.9 s; scheduler tls://127.0.0.1:35133": "registered in 12 s; scheduler tls://127.0.0.1:4001",
        "job 2 running: 8 running; 16s": "job 731 running: 8 running; 3s",
        "log: ~/.hpc-garage/runs/2.out": f"log: {Path.home()}/.hpc-garage/runs/731.out",
        "least busy GPU 0 of 2-n0-gpu0": "least busy GPU 0 of 731-n0-gpu0",
        "held by pid 812": "held by pid 77",
        "walltime 00:20:00, started 2026-11-27 21:30:05": "walltime 01:00:00, started 2027-01-02 08:01:59",
        "run local-20261127-213931-19549": "run local-20261128-000102-19549",
        "flow-run/0b8c6a2e-5d0f-4c3e-9a51-7f2d1e4c9b10": "flow-run/1c8c6a2e-5d0f-4c3e-9a51-7f2d1e4c9b11",
        "best loss 0.1052 (trial train-c8db380d step 10)": "best loss 0.1052 (trial train-9f0e1d2c step 10)",
    }
    for shown, other in varying.items():
        assert pattern(shown).search(other), shown
    assert not pattern("GPUs 8/8 busy").search("GPUs 7/8 busy")
    assert not pattern("best loss 0.1052 (trial train-c8db380d step 10)").search("best loss 0.1052 (trial train-c8db380d step 9)")
    assert not pattern("on 2 workers").search("on 2 nodes")  # the words around a varying value still count


def test_a_page_whose_output_drifted_fails(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("<!-- test -->\n```console\n$ echo submitted job 12\nsubmitted job 39\n"
                    "$ test 'status 39' = 'status 12' && echo mapped\nmapped\n```\n\n```console\n$ false\n```\n")
    assert [len(b.steps) for b in blocks(page)] == [2]  # the unmarked block is not run
    assert run_page(page, tmp_path, dict(os.environ), needs=set()) == []  # job 39 on the page is 12 here
    page.write_text("<!-- test -->\n```console\n$ echo hello\ngoodbye\n```\n")
    assert "did not print 'goodbye'" in run_page(page, tmp_path, dict(os.environ), needs=set())[0]


# ---- the tutorial, end to end on the local SLURM -------------------------------------------------------------

@pytest.mark.slurm
@pytest.mark.slow
def test_the_tutorial_prints_what_it_shows(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(ROOT / "examples" / "sweep.py", work / "sweep.py")
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    failures = run_page(DOCS / "tutorial" / "index.md", work, env, needs={"slurm"})
    assert not failures, "\n\n".join(failures)


HOW_TOS = ("long-sweeps", "deployments", "doctor", "early-stopping")


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.parametrize("page", HOW_TOS)
def test_the_how_to_transcripts_print_what_they_show(page: str, tmp_path: Path) -> None:
    """Each how-to's tested transcripts, in a directory holding the files they name: the examples, the test
    sweeps, and `lab-gpu-long.yaml` (the local SLURM's lab-gpu with `requeue: auto`, `walltime_margin: 15s`,
    `checkpoint_grace: 5s`, as long-sweeps.md says)."""
    work = tmp_path / "work"
    work.mkdir()
    for source in ("examples/sweep.py", "examples/pruned_sweep.py", "tests/data/fault_sweep.py"):
        shutil.copy(ROOT / source, work / Path(source).name)
    (work / "lab-gpu-long.yaml").write_text((ROOT / "site-configs" / "lab-gpu.yaml").read_text()
                                            + "requeue: auto\nwalltime_margin: 15s\ncheckpoint_grace: 5s\n")
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    if page == "deployments":  # the page's deploy.py, on hpc-garage's server (the page says so)
        code = (DOCS / "how-to" / "deployments.md").read_text().split("```python\n")[1].split("```")[0]
        (work / "deploy.py").write_text(code)
        from hpc_garage.prefect.server import ensure_api

        env |= ensure_api()
    assert blocks(DOCS / "how-to" / f"{page}.md"), f"{page}.md has no tested transcript"
    failures = run_page(DOCS / "how-to" / f"{page}.md", work, env, needs={"slurm"})
    assert not failures, "\n\n".join(failures)


# ---- the built site in a real browser ------------------------------------------------------------------------

@pytest.mark.slow
def test_the_built_site_renders_in_chromium_with_screenshots_kept(tmp_path: Path) -> None:
    """Debian's chromium, headless, opens the built site from disk (as a login node without internet would):
    the front page and a how-to render with their navigation, code blocks and tables; screenshots are kept."""
    _mkdocs()
    from tests.browser import artifacts_dir, chromium_page

    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=ROOT,
                   check=True, capture_output=True, timeout=300)
    shots = artifacts_dir()
    with chromium_page() as page:
        page.goto((site / "index.html").as_uri())
        assert page.locator("nav.md-nav").first.is_visible()
        assert page.locator("article table").count() >= 1
        assert "hpc-garage" in page.title()
        page.screenshot(path=str(shots / "docs-front-page.png"), full_page=False)
        page.goto((site / "how-to" / "site-file.html").as_uri())
        assert page.locator("article pre code").count() >= 3
        assert page.get_by_role("heading", name="1. Find what one node of the partition has").is_visible()
        page.screenshot(path=str(shots / "docs-how-to-site-file.png"), full_page=False)
    for name in ("docs-front-page.png", "docs-how-to-site-file.png"):
        assert (shots / name).stat().st_size > 10_000, name


def test_the_readmes_shown_commands_print_what_it_shows(tmp_path: Path) -> None:
    """The README's tested blocks (no SLURM needed) print what the README shows."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    assert blocks(ROOT / "README.md"), "the README has no tested block"
    failures = run_page(ROOT / "README.md", tmp_path, env, needs=set())
    assert not failures, "\n\n".join(failures)
