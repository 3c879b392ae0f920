"""Model names a config field may hold (lmppo.config.model_names): built-ins, Hub ids, local folders."""

import pytest

from lmppo.config.model_names import check_model_path, hub_repo_id, is_hub_repo_id
from lmppo.errors import ConfigError


@pytest.mark.parametrize("text", ["Qwen/Qwen2.5-0.5B", "gpt2", "org/name.v1", "a_b/c-d"])
def test_valid_hub_ids(text):
    assert is_hub_repo_id(text)


@pytest.mark.parametrize("text", ["a/b/c", "org--x/y", "org/..", ".hidden/x", "org/name.git", "x" * 97, "o/-n", ""])
def test_invalid_hub_ids(text):
    assert not is_hub_repo_id(text)


def test_bare_form_needs_org_and_name():
    assert is_hub_repo_id("gpt2") and not is_hub_repo_id("gpt2", bare=True)


def test_a_local_folder_wins_over_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert hub_repo_id("org/model") == "org/model"
    (tmp_path / "org" / "model").mkdir(parents=True)
    assert hub_repo_id("org/model") is None
    assert hub_repo_id("hub:org/model") == "org/model"  # the prefix says Hub even then
    assert hub_repo_id("smollm2") is None


def test_check_model_path_says_what_is_allowed(tmp_path):
    check_model_path("smollm2", "model.policy")
    check_model_path(str(tmp_path), "model.policy")
    check_model_path("org/name", "model.policy")
    with pytest.raises(ConfigError, match="model.policy.*is empty"):
        check_model_path("", "model.policy")
    with pytest.raises(ConfigError, match="not a valid Hub model id"):
        check_model_path("hub:a/b/c", "model.policy")
    with pytest.raises(ConfigError, match="no such folder; give a local model folder, a Hub model id"):
        check_model_path(str(tmp_path / "missing" / "deeper" / "x"), "model.policy")
