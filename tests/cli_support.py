"""What the command-line tests share: a working base config to break (`env`), running `lmppo` in-process with its
stderr cleaned of progress bars, and the one-clean-line check of a refusal."""

from __future__ import annotations

import copy
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml

from lmppo.apps.cli import main

REWARDS = """
def ok(prompts, completions):
    return [len(c) / 20.0 for c in completions]

def raises(prompts, completions):
    raise ValueError("the scorer crashed")

def text(prompts, completions):
    return "garbage"

def short(prompts, completions):
    return [1.0]

def nan(prompts, completions):
    return [float("nan")] * len(completions)
"""


class _SlowScores(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802
        time.sleep(1.0)
        try:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"[]")
        except OSError:
            pass

    def log_message(self, *args):
        pass


@pytest.fixture()
def slow_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _SlowScores)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


@pytest.fixture()
def env(tmp_path, tiny_model_dir):
    """A working base config (tiny model, prompt file, reward file) that each case breaks in one place."""
    (tmp_path / "prompts.txt").write_text("the movie was\nthis film is\nmy friend felt\nthe story seemed\n")
    (tmp_path / "rewards.py").write_text(REWARDS)
    base = {
        "output_dir": str(tmp_path / "run"),
        "total_episodes": 4,
        "model": {"policy": tiny_model_dir},
        "data": {"prompts": str(tmp_path / "prompts.txt")},
        "rollout": {"batch_size": 4, "max_new_tokens": 4, "stop_token": "none"},
        "reward": {"sources": [{"kind": "function", "path": f"{tmp_path / 'rewards.py'}:ok"}]},
        "ppo": {"num_epochs": 1, "micro_batch_size": 4},
        "log": {"trackers": [], "sample_every": 0},
    }
    return tmp_path, base


def run_cli(argv, capsys) -> tuple[int, str]:
    """Exit code and stderr without the progress bars of transformers."""
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err
    lines = [
        ln
        for ln in err.replace("\r", "\n").splitlines()
        if ln.strip() and "it/s]" not in ln and not ln.startswith(("Loading weights", "Writing model"))
    ]
    return code, "\n".join(lines)


def changed(base: dict, **dotted) -> dict:
    cfg = copy.deepcopy(base)
    for key, value in dotted.items():
        obj = cfg
        *parents, leaf = key.split("__")
        for p in parents:
            obj = obj.setdefault(p, {})
        obj[leaf] = value
    return cfg


def write(tmp_path, name: str, data=None, text=None) -> str:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text if text is not None else yaml.safe_dump(data))
    return str(path)


def assert_one_clean_line(code: int, err: str, *names: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err and len(err.splitlines()) == 1 and err.startswith("error: "), err
    for name in names:
        assert name in err, (name, err)
