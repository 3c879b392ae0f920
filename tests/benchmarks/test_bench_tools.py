"""The benchmark drivers' file handling (benchmarks/speed/compare_trl.py, benchmarks/speed/phase_ab.py): what they
delete, unpack and refuse. Nothing here times anything; timing is the benchmarks' job."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO  # noqa: E402

ROOT = Path(REPO)
sys.path.insert(0, str(ROOT / "benchmarks" / "shared"))
import bench_path  # noqa: E402, F401  (every benchmark folder on the path)
import compare_trl  # noqa: E402
import phase_ab  # noqa: E402


def test_compare_trl_drops_a_workers_model_files_and_keeps_its_figures(tmp_path):
    for folder in ("lmppo_run/checkpoints/iter-5", "trl_output", "policy"):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "model.safetensors").write_bytes(b"\0" * 64)
    (tmp_path / "result.json").write_text("{}")
    (tmp_path / "worker.log").write_text("ok\n")
    compare_trl.drop_weights(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result.json", "worker.log"]
    compare_trl.drop_weights(tmp_path)  # nothing left to drop: no error


def test_phase_ab_unpacks_a_commits_src_and_refuses_a_worker_that_imported_another_lmppo(tmp_path):
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    src = phase_ab.unpack(head, tmp_path / "base")
    committed = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{head}:src/lmppo/__init__.py"], capture_output=True, check=True
    ).stdout
    assert (src / "lmppo" / "__init__.py").read_bytes() == committed
    rows = [{"iteration": 2.0, "rollout": 1.0, "sampling": 0.5, "update": 1.0}]
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"rows": rows, "lmppo": os.path.join(str(src), "lmppo", "__init__.py")}))
    assert phase_ab.read_result(good, src) == rows
    shadowed = tmp_path / "shadowed.json"
    shadowed.write_text(json.dumps({"rows": rows, "lmppo": str(ROOT / "src" / "lmppo" / "__init__.py")}))
    with pytest.raises(SystemExit, match="imported lmppo from"):
        phase_ab.read_result(shadowed, src)


def test_the_gpu_side_by_side_summary_gives_issue_44s_figures():
    import gpu_side_by_side

    def side(eps, peak, updates, compile_s=0.0, decode=None):
        its = [
            dict(wall=1.0, rollout=0.5, update=u, compile=compile_s if i == 0 else 0.0) for i, u in enumerate(updates)
        ]
        return dict(eps=eps, gpu_peak_gib=peak, iterations=its, **({"decode": decode} if decode else {}))

    results = {
        "trl": side(4.0, 25.0, [8.0, 8.0]),
        "critic": side(14.0, 18.0, [9.0, 1.0, 2.0], compile_s=42.0, decode={"native_ms_per_step": 2.5}),
        "shared": side(22.0, 14.0, [3.0, 1.0]),
    }
    lines = gpu_side_by_side.must_show(results)
    assert "critic: episodes/s 3.50x TRL's (issue 44 asks >= 3.5x)" in lines
    assert "shared: episodes/s 5.50x TRL's (issue 44 asks >= 5.0x)" in lines
    assert "critic: GPU peak 18.0 GiB, TRL 25.0 GiB (asks <=)" in lines
    assert "critic: update phase 1.50 s (1.0-2.0; asks <= 1.5 s)" in lines  # iteration 1 left out
    assert "critic: compile time in the first iteration 42.0 s (time/compile)" in lines
    assert "critic: decoding 2.50 ms/step (asks <= 3 ms)" in lines
    assert not any(line.startswith("trl") for line in lines)
