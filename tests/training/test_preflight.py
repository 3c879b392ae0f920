"""What the machine must have, checked before the run folder is made (lmppo.training.preflight)."""

import pytest

from lmppo.config import Config
from lmppo.errors import ConfigError
from lmppo.training.preflight import check_machine, check_tracker_packages


def test_a_missing_tracker_package_is_named_with_its_install_command():
    check_tracker_packages([])  # metrics.jsonl only
    with pytest.raises(ConfigError, match=r"log.trackers.*`mlflow`.*pip install mlflow"):
        check_tracker_packages(["mlflow"])  # not installed in the test environment


def test_flex_attention_is_refused_on_a_cpu():
    cfg = Config(device="cpu")
    cfg.model.attn_implementation = "flex_attention"
    with pytest.raises(ConfigError, match="model.attn_implementation.*does not run on a CPU.*`sdpa`"):
        check_machine(cfg)
    cfg.model.attn_implementation = "sdpa"
    check_machine(cfg)
