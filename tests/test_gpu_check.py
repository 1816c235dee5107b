"""scripts/gpu-check: the prepared check for a machine with real NVIDIA GPUs (issue 31, item 12).

Here (no GPU) it must skip in one line with exit 0; its judging of what the trials saw must fail on each way a
pinning can go wrong. The passes themselves need a GPU: run `bash scripts/gpu-check` there.
"""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SPEC = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(gpu_check)


@pytest.mark.skipif(Path("/dev/nvidia0").exists(), reason="a real NVIDIA GPU is here: the check runs for real")
def test_without_a_gpu_it_skips_in_one_line() -> None:
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["gpu-check: skip: no NVIDIA GPU on this machine (no /dev/nvidia0): "
                                        "nothing to check"]


def view(mask: str, start: float, stop: float, **changes: object) -> dict:
    return {"mask": mask, "pid": 1, "start": start, "stop": stop, "cuda_count": 1,
            "cuda_uuids": [f"GPU-{mask}"], "nvml_uuid": f"GPU-{mask}", **changes}


def test_judge_passes_trials_each_on_its_own_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    views = [view("0", 0, 2), view("1", 0, 2), view("0", 2, 4), view("1", 2, 4)]
    assert gpu_check.judge("t", views, ["0", "1"]) is True
    assert "FAIL" not in capsys.readouterr().out


@pytest.mark.parametrize("views, says", [
    ([view("0", 0, 2, cuda_count=2), view("1", 0, 2)], "saw 2 devices"),
    ([view("0", 0, 2, nvml_uuid="GPU-other"), view("1", 0, 2)], "NVML names GPU-other"),
    ([view("0", 0, 2), view("0", 1, 3), view("1", 0, 2)], "ran on the same GPU at the same time"),
    ([view("0", 0, 2), view("0", 2, 4)], "GPUs used ['0']"),
    ([view("7", 0, 2), view("1", 0, 2), view("0", 0, 2)], "none of this machine's GPUs"),
])
def test_judge_fails_each_wrong_pinning(views: list[dict], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_check.judge("t", views, ["0", "1"]) is False
    out = capsys.readouterr().out
    assert says in out and "gpu-check: FAIL: t: " in out
