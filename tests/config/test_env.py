"""Values from the environment: `$VAR` in path fields, `${VAR}` in HTTP reward headers (lmppo.config.env)."""

import pytest

from lmppo.config import RewardSourceConfig
from lmppo.config.env import expand_env, expand_path, http_headers
from lmppo.errors import ConfigError


def test_path_fields_expand_both_forms_and_home(monkeypatch):
    monkeypatch.setenv("RUNS", "/data/runs")
    monkeypatch.setenv("HOME", "/home/u")
    assert expand_path("$RUNS/a", "output_dir") == "/data/runs/a"
    assert expand_path("${RUNS}x/b", "output_dir") == "/data/runsx/b"
    assert expand_path("~/c", "output_dir") == "/home/u/c"
    assert expand_path("plain/d", "output_dir") == "plain/d"


def test_an_unset_variable_in_a_path_names_it(monkeypatch):
    monkeypatch.delenv("LMPPO_NOT_SET", raising=False)
    with pytest.raises(ConfigError, match="output_dir.*needs environment variable `LMPPO_NOT_SET`, which is not set"):
        expand_path("$LMPPO_NOT_SET/run", "output_dir")


def test_header_templates_expand_and_return_the_secrets(monkeypatch):
    monkeypatch.setenv("TOKEN", "s3cret")
    assert expand_env("Bearer ${TOKEN}", "h") == ("Bearer s3cret", ["s3cret"])
    monkeypatch.setenv("TOKEN", "")
    with pytest.raises(ConfigError, match="`TOKEN`, which is empty"):
        expand_env("Bearer ${TOKEN}", "h")


def _http(headers: dict, path: str = "http://localhost:8000/score") -> RewardSourceConfig:
    return RewardSourceConfig(kind="http", path=path, headers=headers)


def test_http_headers_refuse_what_lmppo_writes_or_http_cannot_carry(monkeypatch):
    monkeypatch.setenv("TOKEN", "abc")
    assert http_headers(_http({"Authorization": "Bearer ${TOKEN}"}), "s") == ({"Authorization": "Bearer abc"}, ["abc"])
    with pytest.raises(ConfigError, match="is set by lmppo itself"):
        http_headers(_http({"Content-Type": "text/plain"}), "s")
    with pytest.raises(ConfigError, match="not a valid HTTP header name"):
        http_headers(_http({"Bad Name": "x"}), "s")
    monkeypatch.setenv("TOKEN", "a\nb")
    with pytest.raises(ConfigError, match=r"line break or control character \(from `TOKEN`\)"):
        http_headers(_http({"X-Key": "${TOKEN}"}), "s")
    with pytest.raises(ConfigError, match="conflicts with the credentials in the URL"):
        http_headers(_http({"Authorization": "x"}, "http://u:p@localhost:8000/score"), "s")
    with pytest.raises(ConfigError, match="only Latin-1"):
        http_headers(_http({"X-Key": "caf\u00e9 \u2603"}), "s")
