"""benchmarks/ by kind: every script sits in a kind folder and has its line in benchmarks/README.md, and the only
committed result is the compact learned-reward record."""

from pathlib import Path

from conftest import REPO  # noqa: E402

BENCHMARKS = Path(REPO) / "benchmarks"
KINDS = ("speed", "memory", "learning", "tools")


def test_every_script_is_in_a_kind_folder_and_listed_in_the_readme():
    assert sorted(p.name for p in BENCHMARKS.glob("*.py")) == []  # none left at the top
    readme = (BENCHMARKS / "README.md").read_text()
    for kind in KINDS:
        # speed/gpu_*.py (issue 32's GPU benchmarks) are added in parallel; their README lines follow them
        scripts = sorted(p.name for p in (BENCHMARKS / kind).glob("*.py") if not p.name.startswith("gpu_"))
        assert scripts, kind
        for name in scripts:
            assert f"| {kind} | `{name}` |" in readme, f"benchmarks/{kind}/{name} has no line in benchmarks/README.md"


def test_results_hold_only_the_compact_records():
    kept = sorted(p.name for p in (BENCHMARKS / "results").rglob("*") if p.is_file())
    assert {"learned_reward.jsonl", "verifiable.jsonl"} <= set(kept)
    assert set(kept) <= {"learned_reward.jsonl", "verifiable.jsonl", "agents.jsonl"}  # agents.py's rows once run
