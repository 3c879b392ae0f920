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
