"""`lmppo train`'s own helpers (lmppo.apps.cli.output_dir_of); its runs are in tests/training and tests/run."""

from lmppo.apps.cli import output_dir_of


def test_output_dir_of_reads_the_command_line_or_the_config(tmp_path):
    assert output_dir_of(["--resume", "runs/a"]) == "runs/a"
    assert output_dir_of(["cfg.yaml", "--output_dir=runs/b"]) == "runs/b"
    assert output_dir_of(["cfg.yaml", "--output_dir", "runs/c"]) == "runs/c"
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("output_dir: runs/d\n")
    assert output_dir_of([str(cfg)]) == "runs/d"
    assert output_dir_of([str(tmp_path / "missing.yaml")]) is None  # only for messages: never raises
