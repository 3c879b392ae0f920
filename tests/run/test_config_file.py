"""A run's config.yaml (lmppo.run.config_file): its header marks it as lmppo's, whatever way to resume it names."""

from lmppo.config import Config
from lmppo.run.config_file import CONFIG_HEADER, is_run_config, write_run_config


def test_lmppos_header_with_either_resume_line_is_recognised(tmp_path):
    plain, drop_in, mine = tmp_path / "a.yaml", tmp_path / "b.yaml", tmp_path / "c.yaml"
    write_run_config(Config(), str(plain))
    write_run_config(Config(), str(drop_in), resume_with="the same script with --resume_from_checkpoint OUTPUT_DIR")
    mine.write_text("# my own notes\noutput_dir: runs/x\n")
    assert plain.read_text().startswith(CONFIG_HEADER)
    assert drop_in.read_text().splitlines()[0].endswith("--resume_from_checkpoint OUTPUT_DIR")
    assert is_run_config(str(plain)) and is_run_config(str(drop_in))
    assert not is_run_config(str(mine)) and not is_run_config(str(tmp_path / "missing.yaml"))
