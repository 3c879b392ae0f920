"""An environment that ends the process or never answers, through the real `lmppo train` command in a subprocess:
one `error:` line naming the environment, the prompt row and the turn, no traceback, a non-zero exit, the process
ends (a hung step's thread does not keep it alive), and the last checkpoint stays for a resume."""

from __future__ import annotations

from test_real_faults import base_config, cli_process, finish

from lmppo.run.manifest import latest_checkpoint, verify_checkpoint

ENVIRONMENTS = '''
import sys
import threading


class Exits:
    def __init__(self, prompt=""):
        pass

    def reset(self):
        return "count"

    def step(self, action):
        sys.exit("the environment gave up")


class HangsInIteration2:
    """Episodes 5 on (iteration 2 of batches of 4) never return from their step."""

    built = 0

    def __init__(self, prompt=""):
        type(self).built += 1
        self.hangs = type(self).built > 4

    def reset(self):
        return "count"

    def step(self, action):
        if self.hangs:
            threading.Event().wait()
        return None, 1.0, True
'''


def environment_config(tmp_path, model_dir: str, out: str, name: str, **extra) -> str:
    path = tmp_path / "my_envs.py"
    path.write_text(ENVIRONMENTS)
    return base_config(
        tmp_path,
        model_dir,
        out,
        environment__path=f"{path}:{name}",
        rollout__stop_token="<|im_end|>",
        reward__sources=[],
        **extra,
    )


def _no_traceback(lines: list[str]) -> None:
    assert not any("Traceback" in ln or "Exception ignored" in ln for ln in lines), lines


def test_sys_exit_in_a_step_is_one_error_line(tmp_path, tiny_model_dir):
    out = str(tmp_path / "run")
    rc, lines = finish(cli_process(["train", environment_config(tmp_path, tiny_model_dir, out, "Exits")]))
    errors = [ln for ln in lines if ln.startswith("error:")]
    assert rc == 2 and len(errors) == 1, (rc, lines)
    _no_traceback(lines)
    assert f"environment `{tmp_path / 'my_envs.py'}:Exits`, prompt row " in errors[0]
    assert ", turn 1: step() raised SystemExit (it called sys.exit('the environment gave up')" in errors[0]


def test_a_step_that_never_returns_ends_the_run_at_the_timeout_and_keeps_the_checkpoint(tmp_path, tiny_model_dir):
    out = str(tmp_path / "run")
    cfg = environment_config(tmp_path, tiny_model_dir, out, "HangsInIteration2", environment__step_timeout=2)
    rc, lines = finish(cli_process(["train", cfg]), timeout=600)  # returns: the process ended
    errors = [ln for ln in lines if ln.startswith("error:")]
    assert rc == 2 and len(errors) == 1, (rc, lines)
    _no_traceback(lines)
    assert ", turn 1: step() did not return within environment.step_timeout (2 s)" in errors[0]
    checkpoint = latest_checkpoint(out)
    assert (
        checkpoint is not None and checkpoint.endswith("iter-00000001") and verify_checkpoint(checkpoint)
    )  # iteration 1
