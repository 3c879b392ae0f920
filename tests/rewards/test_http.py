"""The HTTP reward source against a real local HTTP/1.1 server: configured headers with secrets from the
environment (sent, never shown or written), `Retry-After` honoured, one kept-alive connection per run."""

from __future__ import annotations

import json
import os
import re
import threading
import time
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml

from cli_support import assert_one_clean_line, changed, env, run_cli, write  # noqa: F401  (env: a fixture)
from lmppo.apps.cli import main
from lmppo.config import Config, RewardConfig, RewardSourceConfig, load_config, save_config
from lmppo.errors import ConfigError, RewardError
from lmppo.rewards import build_reward_sources
from lmppo.rewards.http import HttpSource, retry_after_seconds
from lmppo.rewards.http_url import check_http_url, check_reward_urls
from lmppo.rewards.sources import SourceContext
from lmppo.run.config_file import redacted_config_dict

SECRET = "s3cr3t-Tok3n-value-42"


class Scores(BaseHTTPRequestHandler):
    """Scores by path; records every request (path, arrival time, Authorization header) on the server."""

    protocol_version = "HTTP/1.1"  # keep-alive unless a handler closes

    def log_message(self, *args):
        pass

    def do_POST(self):  # noqa: N802
        n = len(json.loads(self.rfile.read(int(self.headers["Content-Length"])))["completions"])
        self.server.requests.append(
            (self.path, time.monotonic(), self.headers.get("Authorization"), self.headers.get("X-Team"))
        )
        seen = sum(1 for p, *_ in self.server.requests if p == self.path)
        if self.path == "/echo":  # an error page that repeats the request's credentials back
            return self.reply(401, f"bad token: {self.headers.get('Authorization')}")
        if self.path == "/busy-seconds" and seen == 1:
            return self.reply(503, "busy", {"Retry-After": "1"})
        if self.path == "/busy-date" and seen == 1:
            now = time.time()
            return self.reply(
                429,
                "slow down",
                {"Date": formatdate(now, usegmt=True), "Retry-After": formatdate(now + 1, usegmt=True)},
            )
        if self.path == "/busy-long":
            return self.reply(503, "maintenance", {"Retry-After": "3600"})
        if self.path == "/close-every-2nd" and seen % 2 == 0:  # says so: `Connection: close`
            return self.reply(200, [1.0] * n, {"Connection": "close"}, close=True)
        if self.path == "/drop-idle" and seen == 2:  # closes without saying: the client learns on its next request
            return self.reply(200, [1.0] * n, close=True)
        return self.reply(200, [float(seen)] * n)

    def reply(self, status, payload, headers=(), close=False):
        data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        for key, value in dict(headers).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)
        self.close_connection = close


class CountingServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, handler):
        super().__init__(("127.0.0.1", 0), handler)
        self.connections = 0
        self.requests: list = []

    def process_request(self, request, client_address):  # once per accepted TCP connection
        self.connections += 1
        super().process_request(request, client_address)


@pytest.fixture()
def server():
    srv = CountingServer(Scores)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.fixture(autouse=True)
def quiet_env(monkeypatch):
    for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    monkeypatch.setenv("MY_TOKEN", SECRET)
    monkeypatch.setattr(HttpSource, "backoff", 0.01)  # so a wait of a second can only be the server's Retry-After


def url(srv, path):
    return f"http://127.0.0.1:{srv.server_address[1]}{path}"


def source(address, **kw):
    return build_reward_sources(RewardConfig(sources=[RewardSourceConfig(kind="http", path=address, **kw)]))[0]


BEARER = {"Authorization": "Bearer ${MY_TOKEN}", "X-Team": "rl-${MY_TOKEN}-x"}


# ----------------------------------------------------------------------------- headers and secrets


def test_headers_are_sent_with_the_variable_expanded(server):
    assert source(url(server, "/ok"), headers=BEARER)(["p"], ["c"]) == [1.0]
    _, _, auth, team = server.requests[-1]
    assert auth == f"Bearer {SECRET}" and team == f"rl-{SECRET}-x"


def test_a_server_echoing_the_secret_has_it_masked_in_the_message(server):
    with pytest.raises(RewardError) as info:
        source(url(server, "/echo"), headers=BEARER, retries=0)(["p"], ["c"])
    assert "answered HTTP 401: 'bad token: Bearer ***'" in str(info.value) and SECRET not in str(info.value)


def test_saved_config_keeps_the_reference_not_the_secret(tmp_path):
    cfg = Config()
    cfg.reward.sources = [RewardSourceConfig(kind="http", path="http://127.0.0.1:9/score", headers=BEARER)]
    save_config(cfg, str(tmp_path / "c.yaml"))
    text = (tmp_path / "c.yaml").read_text()
    assert SECRET not in text and "Bearer ${MY_TOKEN}" in text
    assert load_config(str(tmp_path / "c.yaml")).reward.sources[0].headers == BEARER  # round trip
    redacted = redacted_config_dict(cfg)["reward"]["sources"][0]["headers"]
    assert redacted == BEARER  # a reference to a variable is no secret: kept, so a resume can use it again
    cfg.reward.sources[0].headers = {"Authorization": "Bearer literal-secret-in-the-file", "X-Api-Key": "k-123456"}
    assert redacted_config_dict(cfg)["reward"]["sources"][0]["headers"] == {"Authorization": "***", "X-Api-Key": "***"}


def test_missing_variable_is_one_line_naming_field_and_variable(env, capsys, monkeypatch):
    tmp_path, base = env
    monkeypatch.delenv("MY_TOKEN")
    cfg = changed(base, reward__sources=[{"kind": "http", "path": "http://127.0.0.1:9/score", "headers": BEARER}])
    code, err = run_cli(["train", write(tmp_path, "c.yaml", data=cfg)], capsys)
    assert_one_clean_line(code, err, "reward.sources[0].headers.Authorization", "`MY_TOKEN`", "not set")
    assert not os.path.exists(base["output_dir"])  # refused before the run started
    monkeypatch.setenv("MY_TOKEN", "")
    code, err = run_cli(["train", write(tmp_path, "c.yaml", data=cfg)], capsys)
    assert_one_clean_line(code, err, "reward.sources[0].headers.Authorization", "`MY_TOKEN`", "empty")


@pytest.mark.parametrize(
    "headers, says",
    [
        ({"Bad Name": "x"}, "not a valid HTTP header name"),
        ({"Content-Length": "3"}, "set by lmppo itself"),
        ({"X-Team": "a\nInjected: yes"}, "line break or control character"),
        ({"X-Team": ["a"]}, "must be a string"),
    ],
)
def test_bad_headers_are_refused(headers, says):
    cfg = Config()
    with pytest.raises(ConfigError, match=says):
        cfg.reward.sources = [RewardSourceConfig(kind="http", path="http://127.0.0.1:9/score", headers=headers)]
        cfg.validate()


def test_headers_on_another_kind_and_next_to_url_credentials_are_refused():
    cfg = Config()
    cfg.reward.sources = [RewardSourceConfig(kind="function", path="m:f", headers={"X-Team": "a"})]
    with pytest.raises(ConfigError, match=r"headers`.*are for `http` sources"):
        cfg.validate()
    cfg.reward.sources = [RewardSourceConfig(kind="http", path="http://u:p@127.0.0.1:9/s", headers=BEARER)]
    with pytest.raises(ConfigError, match="conflicts with the credentials in the URL"):
        cfg.validate()


def test_a_run_never_shows_or_writes_the_secret(env, capsys, server):
    tmp_path, base = env
    cfg = changed(base, reward__sources=[{"kind": "http", "path": url(server, "/ok"), "headers": BEARER}])
    capsys.readouterr()
    assert main(["train", write(tmp_path, "c.yaml", data=cfg)]) == 0
    out = capsys.readouterr()
    assert server.requests and all(auth == f"Bearer {SECRET}" for _, _, auth, _ in server.requests)
    assert SECRET not in out.out + out.err
    written = [os.path.join(d, f) for d, _, files in os.walk(base["output_dir"]) for f in files]
    assert any(p.endswith("config.yaml") for p in written)
    for path in written:
        with open(path, "rb") as fh:
            assert SECRET.encode() not in fh.read(), path
    saved = yaml.safe_load(open(os.path.join(base["output_dir"], "config.yaml")))
    assert saved["reward"]["sources"][0]["headers"]["Authorization"] == "Bearer ${MY_TOKEN}"
    # the run failing on the server's answer: the error line masks the echoed secret too
    cfg = changed(
        cfg,
        output_dir=str(tmp_path / "run2"),
        reward__sources=[{"kind": "http", "path": url(server, "/echo"), "headers": BEARER, "retries": 0}],
    )
    code, err = run_cli(["train", write(tmp_path, "c2.yaml", data=cfg)], capsys)
    assert_one_clean_line(code, err, "HTTP 401", "Bearer ***")
    assert SECRET not in err


# ----------------------------------------------------------------------------- Retry-After


def test_retry_after_values():
    assert retry_after_seconds("2") == 2.0
    assert retry_after_seconds(" 0 ") == 0.0
    assert retry_after_seconds("-5") == 0.0
    assert retry_after_seconds(None) is None and retry_after_seconds("soon") is None
    date = "Wed, 25 Nov 2026 10:00:00 GMT"
    assert retry_after_seconds("Wed, 25 Nov 2026 10:00:30 GMT", date) == 30.0  # measured from the answer's Date
    assert retry_after_seconds("Wed, 25 Nov 2026 09:59:00 GMT", date) == 0.0  # in the past: at once
    no_date_now = 1795600000.0  # 2026-11-25 09:46:40 UTC
    assert retry_after_seconds("Wed, 25 Nov 2026 09:47:00 GMT", None, now=no_date_now) == 20.0


@pytest.mark.parametrize("path, status", [("/busy-seconds", 503), ("/busy-date", 429)])
def test_retry_after_is_waited(server, path, status):
    assert source(url(server, path), retries=1)(["p"], ["c"]) == [2.0]
    (_, first, *_), (_, second, *_) = server.requests
    assert second - first >= 1.0  # the hinted second, though the backoff would have been 0.01 s


def test_retry_after_longer_than_lmppo_waits_is_named(server):
    with pytest.raises(
        RewardError,
        match=r"answered HTTP 503: 'maintenance' \(Retry-After: 3600 s\), longer than "
        r"lmppo waits \(120 s\)$",
    ):
        source(url(server, "/busy-long"), retries=3)(["p"], ["c"])
    assert len(server.requests) == 1


# ----------------------------------------------------------------------------- one connection


def test_calls_share_one_kept_alive_connection(server):
    src = source(url(server, "/ok"))
    assert [src(["p"], ["c"]) for _ in range(6)] == [[float(i)] for i in range(1, 7)]
    assert server.connections == 1


def test_a_connection_the_server_closes_is_opened_again(server):
    src = source(url(server, "/close-every-2nd"), retries=0)
    assert [src(["p"], ["c"]) for _ in range(6)] == [[1.0], [1.0], [3.0], [1.0], [5.0], [1.0]]
    assert len(server.requests) == 6 and server.connections == 3  # requests 2, 4, 6 closed theirs


def test_an_idle_connection_dropped_by_the_server_is_replaced_without_a_retry(server):
    src = source(url(server, "/drop-idle"), retries=0)  # no retries: the replay is not one
    assert [src(["p"], ["c"]) for _ in range(4)] == [[1.0], [1.0], [3.0], [4.0]]
    assert server.connections == 2 and len(server.requests) == 4


def test_through_a_proxy_from_the_environment(server, monkeypatch):
    monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.setenv("no_proxy", "")
    src = source("http://reward.invalid/score", headers=BEARER)
    assert src(["p"], ["c"]) == [1.0] and src(["p"], ["c"]) == [2.0]
    path, _, auth, _ = server.requests[-1]
    assert path == "http://reward.invalid/score" and auth == f"Bearer {SECRET}" and server.connections == 1


# ----------------------------------------------------------------------------- the URL, checked before training


@pytest.mark.parametrize(
    "bad, says",
    [
        ("http://127.0.0.1:99999/score", "has port `99999`; a port is a number from 1 to 65535"),
        ("http://127.0.0.1:0/score", "has port `0`"),
        ("http://127.0.0.1:8o8o/score", "has port `8o8o`"),
        ("https://user:pw@[::1]:70000/score", "has port `70000`"),
        ("ftp://127.0.0.1/score", "has scheme `ftp`; must be an http:// or https:// URL"),
        ("http:///score", "names no host"),
        ("http://user@:80/score", "names no host"),
        ("http://127.0.0.1/sco re", "holds a space or control character"),
    ],
)
def test_a_bad_url_is_one_config_error_naming_the_field(bad, says):
    reward = RewardConfig(sources=[RewardSourceConfig(kind="function", path="m:f"), RewardSourceConfig("http", bad)])
    with pytest.raises(ConfigError, match=r"^config field `reward.sources\[1\].path` = .*: " + re.escape(says)):
        check_reward_urls(reward)
    with pytest.raises(RewardError, match=re.escape(says)):  # the source itself, built without the early check
        HttpSource(RewardSourceConfig("http", bad), SourceContext(device="cpu"))


def test_good_urls_pass_and_credentials_stay_masked():
    for good in ("http://127.0.0.1:8080/score", "https://example.com", "HTTP://[::1]:65535/s?x=1", "http://h:1/"):
        check_http_url(good, "f")
    with pytest.raises(ConfigError) as info:
        check_http_url(f"http://bob:{SECRET}@example.com:99999/s", "f")
    assert SECRET not in str(info.value)


def test_port_out_of_range_is_refused_by_the_cli_before_any_model_loads(env, capsys):
    tmp_path, base = env
    cfg = changed(base, reward__sources=[{"kind": "http", "path": "http://127.0.0.1:99999/score"}])
    code, err = run_cli(["train", write(tmp_path, "c.yaml", data=cfg)], capsys)
    assert_one_clean_line(code, err, "reward.sources[0].path", "99999", "1 to 65535")
    assert "Port out of range" not in err and "Traceback" not in err
    assert not os.path.exists(base["output_dir"])  # refused before the run started


def test_a_proxy_without_a_host_is_one_error_with_its_password_masked(monkeypatch):
    monkeypatch.setenv("http_proxy", f"http://bob:{SECRET}@:8080")
    monkeypatch.setenv("no_proxy", "")
    src = source("http://reward.invalid/score", retries=0)
    with pytest.raises(RewardError, match=r"the http proxy the environment names \(.*\) has no host") as info:
        src(["p"], ["c"])
    assert SECRET not in str(info.value)
