"""`lmppo --help`, `lmppo --version` and `lmppo train --help`: generated from the schema and the registries, every
field documented (the fields of each reward source included), no Python reprs, and no torch imported."""

from __future__ import annotations

import re
import subprocess
import sys

from lmppo.apps.cli import COMMANDS, main
from lmppo.config import all_fields
from lmppo.registry import REWARD_SOURCES, SAMPLING_ENGINES, TRACKERS


def _out(argv, capsys) -> str:
    capsys.readouterr()
    assert main(argv) == 0
    return capsys.readouterr().out


def test_main_help_lists_every_command_with_one_line(capsys):
    out = _out(["--help"], capsys)
    for name in COMMANDS:
        (line,) = [ln for ln in out.splitlines() if ln.strip().startswith(name + " ")]
        assert len(line.split()) > 3, line  # the name, then what it does
    assert "--version" in out


def test_train_help_documents_each_reward_source_field_with_its_kinds(capsys):
    out = _out(["train", "--help"], capsys)
    section = out[out.index("--reward.sources") : out.index("--reward.truncation")]
    for field in ("kind", "path", "name", "weight", "timeout", "retries", "headers", "span_placement", "input"):
        assert re.search(rf"^\s+{field} \S+   \(default: ", section, re.M), field
    assert "kind {" + ",".join(REWARD_SOURCES.names()) + "}   (default: function)" in section
    assert "timeout FLOAT   (default: 30)" in section and "seconds to wait for an answer" in section
    assert "span_placement {last,spread}   (default: last)" in section
    by_kind = next(ln for ln in section.splitlines() if "fields by kind:" in ln)
    assert "http: path, name, weight, timeout, retries, headers, span_placement" in by_kind
    assert "function: path, name, weight, span_placement;" in by_kind  # no HTTP-only or model-only field


def test_train_help_has_every_option_and_no_python_reprs(capsys):
    out = _out(["train", "--help"], capsys)
    for name, *_ in all_fields():
        assert f"--{name} " in out, name
    assert "RewardSourceConfig(" not in out and "(default: '" not in out and "(default: False)" not in out
    assert "--output_dir STR   (default: runs/default)" in out and "--overwrite BOOL   (default: false)" in out
    assert '--deepspeed STR   (default: "")' in out


def test_choices_come_from_the_registries(capsys):
    out = _out(["train", "--help"], capsys)
    assert "--rollout.backend {" + ",".join(SAMPLING_ENGINES.names()) + "}" in out
    assert "--log.trackers LIST[{" + ",".join(TRACKERS.names()) + "}]" in out
    SAMPLING_ENGINES.register("lmppo_test_engine")(object)
    try:
        assert "lmppo_test_engine}" in _out(["train", "--help"], capsys)  # a new engine: listed, and allowed
    finally:
        del SAMPLING_ENGINES["lmppo_test_engine"]


def test_version_and_help_import_no_torch():
    code = (
        "import sys\n"
        "from lmppo.apps.cli import main\n"
        "assert main(['--version']) == 0 and main(['--help']) == 0 and main(['train', '--help']) == 0\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'accelerate', 'rich'))\n"
        "assert not heavy, heavy\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "lmppo", "--version"], capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stdout.startswith("lmppo ")
    assert not re.search(r"\|\s+torch$", out.stderr, re.M)


def test_every_commands_help_and_argument_errors_import_no_torch():
    """`lmppo eval|merge|plot|push|warp|reward-model --help` and their argument mistakes answer before torch,
    transformers, accelerate or rich load (each command's parser lives in lmppo.apps.arguments or
    lmppo.evaluation.arguments)."""
    code = (
        "import sys\n"
        "from lmppo.apps.cli import main\n"
        "for name in ('eval', 'merge', 'plot', 'push', 'warp', 'reward-model'):\n"
        "    assert main([name, '--help']) == 0, name\n"
        "assert main(['merge', 'run_a']) == 2  # --output missing\n"
        "assert main(['push', 'run_a']) == 2  # --repo-id missing\n"
        "assert main(['plot']) == 2  # no run folder\n"
        "assert main(['eval', 'run_a', '--samples-per-prompt', 'many']) == 2\n"
        "assert main(['eval', 'run_a', '--rollout.temprature', '1']) == 2  # an unknown override\n"
        "assert main(['warp', '--members', '3']) == 2  # --kl-budget missing\n"
        "assert main(['reward-model', '--epochs', 'two']) == 2  # the old spelling\n"
        "assert main(['reward-model', '--training.epochs', 'two']) == 2\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'accelerate', 'rich'))\n"
        "assert not heavy, heavy[:5]\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage: lmppo eval" in out.stdout and "usage: lmppo warp" in out.stdout
    assert "lmppo merge: error: the following arguments are required: --output/-o" in out.stderr
    assert "error: unknown option `--rollout.temprature` (did you mean `--rollout.temperature`?)" in out.stderr


def test_an_unknown_option_is_named_with_the_closest_one(capsys):
    assert main(["train", "--ppo.num_epoch", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: unknown option `--ppo.num_epoch` (did you mean `--ppo.num_epochs`?); see `lmppo train --help`"


def test_train_help_lists_every_value_a_registry_option_takes(capsys):
    out = _out(["train", "--help"], capsys)
    assert "--kl.estimator {k1,k2,k3,exact}   (default: k1)" in out  # `exact` is accepted, so it is listed
    # not only the built-ins: a class of the user's, by module or by file
    assert '--environment.path {tools,guess_number}|module:Class|file.py:Class|textarena:ENV_ID   (default: "")' in out
    assert "Allowed: one of tools, guess_number, or module:Class or file.py:Class or textarena:ENV_ID." in " ".join(
        out.split()
    )


def test_the_old_module_name_lmppo_cli_still_runs_the_command():
    """`python -m lmppo.cli` (the documented launch before the command moved to lmppo.apps.cli) still works, as
    does `python -m lmppo`, the name the docs now give."""
    for module in ("lmppo.cli", "lmppo"):
        out = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True, text=True)
        assert out.returncode == 0 and out.stdout.startswith("lmppo "), (module, out.stderr)
    out = subprocess.run([sys.executable, "-m", "lmppo.cli", "trian"], capture_output=True, text=True)
    assert out.returncode == 2 and "did you mean `train`?" in out.stderr
