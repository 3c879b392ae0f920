"""SIGTERM handled like Ctrl-C (a real signal to a real `lmppo train` process), and the temporaries a killed process
leaves (a real SIGKILL while `.final.tmp-*` exists) removed by the next process that takes the run lock."""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
from test_real_faults import SRC, base_config, cli_process, finish, wait_for_file

import lmppo.run.lock as lock
import lmppo.run.storage as storage
from lmppo.run import signals
from train_worker import read_jsonl

GATE_AT = textwrap.dedent("""
    import os, time

    calls = 0

    def gate(prompts, completions):
        # call GATE_CALL waits until the test signals the process (iteration GATE_CALL, after the checkpoint before it)
        global calls
        calls += 1
        if calls == int(os.environ.get("GATE_CALL", "0")):
            open(os.environ["GATE"] + ".reached", "w").close()
            time.sleep(600)
        return [len(c) / 20.0 for c in completions]
""")

# the real command, with the publication of final/ held (by a sleep) while its `.final.tmp-*` copy is complete
HOLD_FINAL = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {src!r})
    import lmppo.run.storage as storage

    real = storage.publish

    def held(tmp, final_path):
        if os.path.basename(final_path) == "final":
            open(os.environ["GATE"] + ".reached", "w").close()
            time.sleep(600)
        real(tmp, final_path)

    storage.publish = held
    from lmppo.apps.cli import main
    sys.exit(main(sys.argv[1:]))
""")


def gated(tmp_path, tiny_model_dir, out: str) -> str:
    (tmp_path / "gate_at.py").write_text(GATE_AT)
    source = {"kind": "function", "path": f"{tmp_path / 'gate_at.py'}:gate"}
    return base_config(tmp_path, tiny_model_dir, out, reward__sources=[source])


def iterations(out: str) -> list[int]:
    return [r["iteration"] for r in read_jsonl(os.path.join(out, "metrics.jsonl"))]


def test_sigterm_after_a_checkpoint_exits_143_with_resume_advice_and_no_temporaries(tmp_path, tiny_model_dir):
    out, gate = str(tmp_path / "run"), str(tmp_path / "gate")
    proc = cli_process(["train", gated(tmp_path, tiny_model_dir, out)], GATE=gate, GATE_CALL="2")
    wait_for_file(gate + ".reached", proc)  # iteration 1 checkpointed, iteration 2 under way
    proc.send_signal(signal.SIGTERM)
    code, lines = finish(proc)
    assert code == 143 and len(lines) == 1, (code, lines)
    assert lines[0] == (
        f"terminated (SIGTERM); the latest complete checkpoint is intact: resume with `lmppo train --resume {out}`"
    )
    assert storage.temporaries(out) == []
    code, lines = finish(cli_process(["train", "--resume", out]))  # the advice works
    assert code == 0, lines
    assert iterations(out) == [1, 2, 3]


def test_sigterm_before_the_first_checkpoint_advises_overwrite_which_works(tmp_path, tiny_model_dir):
    out, gate = str(tmp_path / "run"), str(tmp_path / "gate")
    cfg = gated(tmp_path, tiny_model_dir, out)
    proc = cli_process(["train", cfg], GATE=gate, GATE_CALL="1")
    wait_for_file(gate + ".reached", proc)
    proc.send_signal(signal.SIGTERM)
    code, lines = finish(proc)
    assert code == 143 and len(lines) == 1, (code, lines)
    advice = f"`lmppo train {cfg} --overwrite true`"
    assert "--resume" not in lines[0] and lines[0].endswith(advice), lines
    code, lines = finish(cli_process(["train", cfg, "--overwrite", "true"]))
    assert code == 0, lines
    assert iterations(out) == [1, 2, 3]


def _held_final(cfg: str, gate: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=SRC, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", GATE=gate)
    return subprocess.Popen(
        [sys.executable, "-c", HOLD_FINAL.format(src=SRC), "train", cfg],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def test_sigterm_while_the_final_model_is_written_removes_its_copy(tmp_path, tiny_model_dir):
    out, gate = str(tmp_path / "run"), str(tmp_path / "gate")
    proc = _held_final(base_config(tmp_path, tiny_model_dir, out, iterations=2), gate)
    wait_for_file(gate + ".reached", proc)
    assert len(glob.glob(os.path.join(out, ".final.tmp-*"))) == 1
    proc.send_signal(signal.SIGTERM)
    code, lines = finish(proc)
    assert code == 143 and len(lines) == 1 and "resume with `lmppo train --resume" in lines[0], (code, lines)
    assert storage.temporaries(out) == [] and not os.path.exists(os.path.join(out, "final"))


def test_sigkill_while_the_final_model_is_written_the_next_lock_holder_removes_the_copy(tmp_path, tiny_model_dir):
    out, gate = str(tmp_path / "run"), str(tmp_path / "gate")
    cfg = base_config(tmp_path, tiny_model_dir, out, iterations=2)
    for argv in (["--resume", out], ["--resume", out, "--total_episodes", "12"], [cfg, "--overwrite", "true"]):
        shutil.rmtree(out, ignore_errors=True)
        proc = _held_final(cfg, gate)
        wait_for_file(gate + ".reached", proc)
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
        os.unlink(gate + ".reached")
        left = glob.glob(os.path.join(out, ".final.tmp-*"))
        assert len(left) == 1 and os.path.isfile(os.path.join(left[0], "policy", "model.safetensors"))
        code, lines = finish(cli_process(["train", *argv]))
        assert code == 0, (argv, lines)
        assert storage.temporaries(out) == [] and os.path.isdir(os.path.join(out, "final", "policy")), argv


def test_the_lock_taker_removes_every_kind_of_leftover_and_nothing_else(tmp_path):
    out = tmp_path / "run"
    leftovers = [
        ".final.tmp-0123abcd/policy/model.safetensors",
        ".final.old-89abcdef/policy/config.json",
        ".metrics.jsonl.tmp-deadbeef",
        ".summary.json.tmp-00ff00ff",
        "checkpoints/.iter-00000002.tmp/optimizer.pt",
        "checkpoints/.iter-00000001.del-a1b2c3d4/state.json",
        "checkpoints/.iter-00000003.tmp-1234abcd/x",
        "reward_curves.png.tmp-4242.png",
    ]
    users = ["notes.tmp", "my.tmp-file", "final/policy/eval.tmp", ".hidden.tmp-notahex", "checkpoints/NOTES.txt"]
    users.append("data/a/b/c/.deep.tmp-0123abcd")  # deeper than lmppo writes: not walked
    for rel in leftovers + users:
        path = out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x")
    found = sorted(os.path.relpath(p, out) for p in storage.temporaries(str(out)))
    assert found == sorted(
        [
            ".final.tmp-0123abcd",
            ".final.old-89abcdef",
            ".metrics.jsonl.tmp-deadbeef",
            ".summary.json.tmp-00ff00ff",
            "checkpoints/.iter-00000002.tmp",
            "checkpoints/.iter-00000001.del-a1b2c3d4",
            "checkpoints/.iter-00000003.tmp-1234abcd",
            "reward_curves.png.tmp-4242.png",
        ]
    )
    lock.acquire(str(out))
    try:
        assert storage.temporaries(str(out)) == []
        for rel in users:
            assert (out / rel).read_text() == "x", rel
    finally:
        lock.release(str(out))


def test_exit_codes_and_advice_without_a_checkpoint(tmp_path):
    assert signals.exit_code(signals.Terminated()) == 143 and signals.exit_code(KeyboardInterrupt()) == 130
    out = str(tmp_path / "run")
    step = signals.next_step(out, ["cfg.yaml", "--overwrite", "false", "--seed", "3"])
    assert step.endswith("`lmppo train cfg.yaml --seed 3 --overwrite true`") and "--resume" not in step
    os.makedirs(os.path.join(out, "checkpoints", "iter-00000001"))
    assert not signals.has_checkpoint(out)  # no manifest: not a published checkpoint
    open(os.path.join(out, "checkpoints", "iter-00000001", "manifest.json"), "w").close()
    assert signals.next_step(out, ["cfg.yaml"]).endswith(f"`lmppo train --resume {out}`")


def test_a_signal_waits_for_a_rename_or_removal_under_way(tmp_path):
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        assert signals.terminate_like_interrupt()
        reached_end = False
        with pytest.raises(signals.Terminated):
            with storage.uninterrupted():
                os.kill(os.getpid(), signal.SIGTERM)  # a real signal, delivered inside the step
                for _ in range(1000):  # the handler runs between bytecodes: it has run by now
                    pass
                reached_end = True
        assert reached_end and storage.interruptible()
    finally:
        signal.signal(signal.SIGTERM, before[0])
        signal.signal(signal.SIGINT, before[1])


def test_a_kill_between_the_two_renames_of_a_publish_brings_the_old_folder_back(tmp_path):
    out = tmp_path / "run"
    (out / ".final.old-0123abcd" / "policy").mkdir(parents=True)  # final/ renamed aside, the new one not yet in
    (out / ".final.old-0123abcd" / "policy" / "my_eval_results.md").write_text("x")
    (out / ".final.tmp-89abcdef" / "policy").mkdir(parents=True)
    lock.acquire(str(out))
    try:
        assert (out / "final" / "policy" / "my_eval_results.md").read_text() == "x"
        assert storage.temporaries(str(out)) == []
    finally:
        lock.release(str(out))
