"""Ambiguous, degenerate and hostile input is refused with one line naming the field (issue 14): duplicate YAML
keys, alias bombs, non-finite and out-of-range floats, a device that cannot be had, `--resume` given a checkpoint
folder or options it would ignore, `overwrite` next to files lmppo did not write, reward code that exits, HTTP
reward servers that trickle or cut off their answer, a run whose checkpoints are all corrupt."""

from __future__ import annotations

import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
import yaml

from cli_support import assert_one_clean_line, changed, env, run_cli, write  # noqa: F401  (env: a fixture)
from lmppo.apps.cli import main
from lmppo.errors import ConfigError

# ----------------------------------------------------------------------------- the config file


def test_duplicate_section_is_an_error_naming_both_lines(env, capsys):
    tmp_path, base = env
    text = yaml.safe_dump(base) + "ppo:\n  learning_rate: 0.5\n"
    first = next(i for i, line in enumerate(text.splitlines(), 1) if line.startswith("ppo:"))
    last = len(text.splitlines()) - 1
    code, err = run_cli(["train", write(tmp_path, "dup.yaml", text=text)], capsys)
    assert_one_clean_line(code, err, "dup.yaml", "`ppo` is given twice", f"line {first} and line {last}")


def test_duplicate_nested_key_is_an_error_naming_both_lines(env, capsys):
    tmp_path, base = env
    text = yaml.safe_dump(base).replace("  batch_size: 4\n", "  batch_size: 4\n  batch_size: 8\n")
    line = text.splitlines().index("  batch_size: 8") + 1
    code, err = run_cli(["train", write(tmp_path, "dup.yaml", text=text)], capsys)
    assert_one_clean_line(code, err, "`batch_size` is given twice", f"line {line - 1} and line {line}")


def test_merge_keys_still_override(tmp_path):
    from lmppo.config.yaml_input import load

    assert load("base: &b {x: 1, y: 2}\nother:\n  <<: *b\n  y: 3\n") == {
        "base": {"x": 1, "y": 2},
        "other": {"x": 1, "y": 3},
    }


def alias_bomb(levels: int = 9) -> str:
    lines = ["    l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for i in range(1, levels):
        lines.append(f"    l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


def test_alias_bomb_in_generation_kwargs_is_refused_quickly(env, capsys):
    tmp_path, base = env
    text = yaml.safe_dump(changed(base, rollout__backend="hf")) + "rollout_extra: 1\n"
    text = text.replace("rollout:\n", "rollout:\n  generation_kwargs:\n" + alias_bomb(), 1)
    text = text.replace("rollout_extra: 1\n", "")
    code, err = run_cli(["train", write(tmp_path, "bomb.yaml", text=text)], capsys)
    assert_one_clean_line(code, err, "bomb.yaml", "aliases", "100000")


def test_alias_bomb_on_the_command_line_is_refused(capsys):
    value = (
        "{" + ", ".join(f"k{i}: &a{i} [" + (", ".join([f"*a{i - 1}"] * 9) if i else "x") + "]" for i in range(9)) + "}"
    )
    assert_one_clean_line(
        *run_cli(["train", "--rollout.generation_kwargs", value], capsys), "rollout.generation_kwargs", "aliases"
    )


def test_error_message_of_a_huge_value_is_bounded():
    value: list = ["x"] * 10
    for _ in range(40):  # 10**40 elements once expanded, all shared
        value = [value] * 10
    message = str(ConfigError("rollout.generation_kwargs", value, "must be a mapping"))
    assert len(message) < 500 and message.endswith("must be a mapping")


BAD_FLOATS = [
    ("rollout__temperature", float("inf"), "`rollout.temperature`", "finite"),
    ("rollout__temperature", 1e-30, "`rollout.temperature`", "[0.01, 100]"),
    ("rollout__temperature", 1e3, "`rollout.temperature`", "[0.01, 100]"),
    ("kl__coef", float("inf"), "`kl.coef`", "finite"),
    ("reward__penalty", float("nan"), "`reward.penalty`", "finite"),
    ("ppo__learning_rate", float("inf"), "`ppo.learning_rate`", "finite"),
    ("ppo__learning_rate", 5.0, "`ppo.learning_rate`", "[0, 1]"),
]


@pytest.mark.parametrize("field,value,name,allowed", BAD_FLOATS, ids=[f"{f}={v}" for f, v, *_ in BAD_FLOATS])
def test_non_finite_and_degenerate_floats_are_refused_before_work(env, capsys, field, value, name, allowed):
    tmp_path, base = env
    text = yaml.safe_dump(changed(base, **{field: value}))
    assert_one_clean_line(*run_cli(["train", write(tmp_path, "c.yaml", text=text)], capsys), name, allowed)
    assert not os.path.exists(base["output_dir"]), "refused before the run folder was made"


def test_reward_weight_inf_is_refused(env, capsys):
    tmp_path, base = env
    cfg = changed(base)
    cfg["reward"]["sources"][0]["weight"] = float("inf")
    assert_one_clean_line(
        *run_cli(["train", write(tmp_path, "c.yaml", data=cfg)], capsys), "`reward.sources[0].weight`", "finite"
    )


def test_help_documents_the_float_ranges(capsys):
    assert main(["train", "--help"]) == 0
    assert "Allowed: [0.01, 100]" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: device cuda is met")
def test_device_cuda_without_a_gpu_is_an_error(env, capsys):
    tmp_path, base = env
    path = write(tmp_path, "c.yaml", data=changed(base, device="cuda"))
    assert_one_clean_line(*run_cli(["train", path], capsys), "`device`", "'cuda'", "no CUDA GPU")


# ----------------------------------------------------------------------------- --resume and overwrite


@pytest.fixture()
def finished_run(env, capsys):
    tmp_path, base = env
    path = write(tmp_path, "config.yaml", data=changed(base, total_episodes=8, checkpoint={"every": 1}))
    code, err = run_cli(["train", path], capsys)
    assert code == 0, err
    return tmp_path, base["output_dir"], path


def test_resume_from_a_checkpoint_folder_names_the_run_folder(finished_run, capsys):
    _tmp, run, _path = finished_run
    ckpt = os.path.join(run, "checkpoints", "iter-00000002")
    before = sorted(os.listdir(ckpt))
    assert_one_clean_line(*run_cli(["train", "--resume", ckpt], capsys), "checkpoint folder", f"--resume {run}`")
    assert sorted(os.listdir(ckpt)) == before  # not turned into a run folder


@pytest.mark.parametrize("option", [["--output_dir", "elsewhere"], ["--overwrite", "true"]])
def test_resume_refuses_options_it_would_ignore(finished_run, capsys, option):
    _tmp, run, _path = finished_run
    assert_one_clean_line(
        *run_cli(["train", "--resume", run, *option], capsys), option[0], "cannot be given with --resume"
    )


def test_resume_refuses_a_config_file_of_another_folder(finished_run, capsys):
    tmp_path, run, _path = finished_run
    other = write(tmp_path, "other.yaml", data={"output_dir": str(tmp_path / "other-run")})
    assert_one_clean_line(*run_cli(["train", other, "--resume", run], capsys), "`output_dir`", "other-run", "--resume")


def test_every_checkpoint_corrupt_is_diagnosed_without_destructive_advice(finished_run, capsys):
    _tmp, run, _path = finished_run
    for name in os.listdir(os.path.join(run, "checkpoints")):
        with open(os.path.join(run, "checkpoints", name, "trained.safetensors"), "r+b") as fh:
            fh.truncate(100)
    code, err = run_cli(["train", "--resume", run], capsys)
    assert_one_clean_line(code, err, "none of its 2 checkpoints verifies", "trained.safetensors", "Nothing was changed")
    assert "overwrite" not in err


def test_no_checkpoint_advice_says_what_overwrite_removes(env, capsys):
    tmp_path, base = env
    path = write(tmp_path, "c.yaml", data=changed(base, total_episodes=4))
    assert run_cli(["train", path], capsys)[0] == 0
    import shutil

    shutil.rmtree(os.path.join(base["output_dir"], "checkpoints"))
    code, err = run_cli(["train", "--resume", base["output_dir"]], capsys)
    assert_one_clean_line(
        code, err, "stopped before its first checkpoint", "`--overwrite true`) (which removes", "metrics.jsonl"
    )


@pytest.mark.parametrize("foreign", ["final", "checkpoints"])
def test_overwrite_never_removes_folders_lmppo_did_not_write(env, capsys, foreign):
    tmp_path, base = env
    out = tmp_path / "run"
    (out / foreign / "mine").mkdir(parents=True)
    (out / foreign / "mine" / "weights.bin").write_bytes(b"precious")
    for overwrite in ("false", "true"):
        path = write(tmp_path, "c.yaml", data=base)
        code, err = run_cli(["train", path, "--overwrite", overwrite], capsys)
        assert_one_clean_line(code, err, f"lmppo did not write ({foreign})", "move them away")
        assert "already holds a run" not in err and "set overwrite" not in err
    assert (out / foreign / "mine" / "weights.bin").read_bytes() == b"precious"


def test_overwrite_removes_only_the_old_runs_files(env, capsys):
    tmp_path, base = env
    path = write(tmp_path, "c.yaml", data=base)
    assert run_cli(["train", path], capsys)[0] == 0
    out = tmp_path / "run"
    (out / "notes.txt").write_text("mine")
    code, err = run_cli(["train", path], capsys)
    assert_one_clean_line(code, err, "already holds a run", "`--overwrite true`: removes those files")
    assert run_cli(["train", path, "--overwrite", "true"], capsys)[0] == 0
    assert (out / "notes.txt").read_text() == "mine"


# ----------------------------------------------------------------------------- reward code that exits

EXITING = """
import sys

def exits(prompts, completions):
    sys.exit(3)
"""


def test_reward_function_that_calls_sys_exit(env, capsys):
    tmp_path, base = env
    (tmp_path / "exiting.py").write_text(EXITING)
    cfg = changed(base, reward__sources=[{"kind": "function", "path": f"{tmp_path / 'exiting.py'}:exits"}])
    assert_one_clean_line(
        *run_cli(["train", write(tmp_path, "c.yaml", data=cfg)], capsys),
        "reward source `exits`",
        "SystemExit",
        "sys.exit(3)",
    )


def test_reward_module_that_exits_at_import(env, capsys):
    tmp_path, base = env
    (tmp_path / "exit_at_import.py").write_text("raise SystemExit(4)\n\ndef ok(p, c):\n    return [0.0] * len(c)\n")
    cfg = changed(base, reward__sources=[{"kind": "function", "path": f"{tmp_path / 'exit_at_import.py'}:ok"}])
    assert_one_clean_line(
        *run_cli(["train", write(tmp_path, "c.yaml", data=cfg)], capsys),
        "exit_at_import.py",
        "SystemExit",
        "sys.exit(4)",
    )


def test_ctrl_c_in_a_reward_function_says_how_to_start_again(env, capsys):
    """Interrupted before the first checkpoint: nothing to resume, so the advice is the command that works."""
    tmp_path, base = env
    (tmp_path / "ctrl_c.py").write_text("def stop(p, c):\n    raise KeyboardInterrupt\n")
    cfg = changed(base, reward__sources=[{"kind": "function", "path": f"{tmp_path / 'ctrl_c.py'}:stop"}])
    path = write(tmp_path, "c.yaml", data=cfg)
    code, err = run_cli(["train", path], capsys)
    assert code == 130 and "nothing to resume" in err and f"`lmppo train {path} --overwrite true`" in err


# ----------------------------------------------------------------------------- HTTP reward servers


class _Trickle(BaseHTTPRequestHandler):
    """Answers a valid JSON list, one byte every 0.05 s: each read is quick, the whole answer takes seconds."""

    def do_POST(self):  # noqa: N802
        n = len(json.loads(self.rfile.read(int(self.headers["Content-Length"])))["completions"])
        body = json.dumps([0.5] * n).encode() + b" " * 40
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            for i in range(len(body)):
                self.wfile.write(body[i : i + 1])
                self.wfile.flush()
                time.sleep(0.05)
        except OSError:
            pass

    def log_message(self, *args):
        pass


class _CutOff(BaseHTTPRequestHandler):
    """Cuts the answer off (Content-Length larger than what is sent) on the first `cut` requests."""

    cut = 1
    seen = 0

    def do_POST(self):  # noqa: N802
        n = len(json.loads(self.rfile.read(int(self.headers["Content-Length"])))["completions"])
        body = json.dumps([0.5] * n).encode()
        type(self).seen += 1
        self.send_response(200)
        self.send_header("Content-Length", str(len(body) + (100 if type(self).seen <= type(self).cut else 0)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = True

    def log_message(self, *args):
        pass


def serve(handler):
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_http_reward_timeout_is_a_total_deadline(env, capsys):
    tmp_path, base = env
    server = serve(_Trickle)
    try:
        url = f"http://user:pa55word@127.0.0.1:{server.server_address[1]}/score"
        cfg = changed(base, reward__sources=[{"kind": "http", "path": url, "timeout": 0.5, "retries": 0}])
        code, err = run_cli(["train", write(tmp_path, "c.yaml", data=cfg)], capsys)
        assert_one_clean_line(
            code, err, "within 0.5 s", "total deadline", f"http://***@127.0.0.1:{server.server_address[1]}/score"
        )
        assert "pa55word" not in err
    finally:
        server.shutdown()
        server.server_close()


def test_http_reward_cut_off_answer_is_retried_then_named(env, capsys):
    tmp_path, base = env
    _CutOff.cut, _CutOff.seen = 1, 0
    server = serve(_CutOff)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/score"
        cfg = changed(base, reward__sources=[{"kind": "http", "path": url, "timeout": 5, "retries": 2}])
        code, err = run_cli(["train", write(tmp_path, "c.yaml", data=cfg)], capsys)
        assert code == 0, err  # the first answer was cut off, the retry was whole
        _CutOff.cut, _CutOff.seen = 10**6, 0
        cfg = changed(
            base,
            output_dir=str(tmp_path / "run2"),
            reward__sources=[{"kind": "http", "path": url, "timeout": 5, "retries": 1}],
        )
        code, err = run_cli(["train", write(tmp_path, "c2.yaml", data=cfg)], capsys)
        assert_one_clean_line(code, err, url, "cut off", "after 2 attempts")
    finally:
        server.shutdown()
        server.server_close()
