"""The cases of issue 41, each produced for real and run through the real `lmppo` command (a fresh process each):
a model folder whose config.json and weights disagree, a prompt file shuffled under a stopped run, an ownership record
of an older lmppo, a read-only run folder and cache (real read-only tmpfs mounts), signals during start-up, training,
`lmppo eval` and `lmppo merge`, a second Ctrl-C 20 ms after the first, a linked `checkpoints/`, a moved model folder,
a cache that fills up during the SmolLM2 conversion, huge rewards, and the lock file of a finished run.

    python benchmarks/tools/fault_cases.py [--work DIR]      (or benchmarks/tools/fault_injection.py --cases)

Prints one row per case: what was done, the exit code, the lines on stderr (each must be one line) and whether every
file of the user's is still there; exit code 1 when a case did not end as it must. Mounting needs root: the cases that
mount are reported as skipped otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

HERE = Path(__file__).resolve()
SRC = str(HERE.parents[2] / "src")
HOLD = """
import os, sys, time
sys.path.insert(0, {src!r})
import {module} as target
real = getattr(target, {name!r})
def held(*args, **kwargs):
    out = real(*args, **kwargs)
    open(os.environ["GATE"], "w").close()
    time.sleep(600)
    return out
setattr(target, {name!r}, held)
from lmppo.apps.cli import main
sys.exit(main())
"""
"""A real `lmppo` process held (a sleep) right after `module.name` returns, so a signal lands there."""


class Cases:
    def __init__(self, work: str, model_dir: str, prompts: str, reward: str):
        self.work, self.model_dir, self.prompts, self.reward = work, model_dir, prompts, reward
        self.rows: list[dict] = []
        self.mounts: list[str] = []

    # ------------------------------------------------------------------ helpers
    def env(self, **extra: str) -> dict:
        return dict(os.environ, PYTHONPATH=SRC, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", **extra)

    def config(self, name: str, iterations: int = 2, **fields) -> tuple[str, str]:
        import yaml

        out = os.path.join(self.work, name)
        cfg = {
            "output_dir": out,
            "total_episodes": 4 * iterations,
            "precision": "fp32",
            "model": {"policy": self.model_dir},
            "data": {"prompts": self.prompts},
            "rollout": {"batch_size": 4, "max_new_tokens": 4, "stop_token": "none"},
            "reward": {"sources": [{"kind": "function", "path": self.reward}]},
            "ppo": {"num_epochs": 1, "micro_batch_size": 4},
            "log": {"trackers": [], "sample_every": 0},
            "checkpoint": {"every": 1},
            **fields,
        }
        path = out + ".yaml"
        with open(path, "w") as fh:
            yaml.safe_dump(cfg, fh)
        return path, out

    def lmppo(self, argv: list[str], signal_after: Optional[float] = None, sig: int = 0, **env: str) -> tuple:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lmppo.apps.cli", *argv],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=self.env(**env),
            preexec_fn=_ctrl_c_as_in_a_terminal,
        )
        if signal_after is not None:
            time.sleep(signal_after)
            proc.send_signal(sig)
        _, err = proc.communicate(timeout=900)
        return proc.returncode, [ln for ln in err.splitlines() if ln.strip()]

    def held(self, module: str, name: str, argv: list[str], sigs: list[int], gap: float = 0.0) -> tuple:
        gate = os.path.join(self.work, f"gate-{len(self.rows)}")
        script = os.path.join(self.work, f"held-{len(self.rows)}.py")
        with open(script, "w") as fh:
            fh.write(HOLD.format(src=SRC, module=module, name=name))
        proc = subprocess.Popen(
            [sys.executable, script, *argv],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=self.env(GATE=gate),
            preexec_fn=_ctrl_c_as_in_a_terminal,
        )
        while not os.path.exists(gate) and proc.poll() is None:
            time.sleep(0.02)
        for i, sig in enumerate(sigs):
            if i:
                time.sleep(gap)
            proc.send_signal(sig)
        _, err = proc.communicate(timeout=900)
        return proc.returncode, [ln for ln in err.splitlines() if ln.strip()]

    def mount(self, options: str) -> Optional[str]:
        mnt = tempfile.mkdtemp(prefix="mnt-", dir=self.work)
        if os.geteuid() != 0 or shutil.which("mount") is None:
            return None
        if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", mnt], capture_output=True).returncode:
            return None
        self.mounts.append(mnt)
        return mnt

    def record(self, case: str, what: str, result: tuple, must: Callable[[int, list[str]], bool], kept: bool = True):
        code, lines = result
        ok = bool(must(code, lines)) and kept
        self.rows.append({"case": case, "what": what, "rc": code, "lines": lines, "kept": kept, "ok": ok})

    def skip(self, case: str, what: str, why: str) -> None:
        self.rows.append(
            {"case": case, "what": what, "rc": None, "lines": [f"(skipped: {why})"], "kept": True, "ok": True}
        )

    # ------------------------------------------------------------------ the cases
    def strict_loads(self) -> None:
        import torch  # noqa: F401

        from conftest import tiny_llama
        from helpers_tokenizers import make_bpe_tokenizer

        tok = make_bpe_tokenizer()
        for layers in (6, 2):
            folder = os.path.join(self.work, f"model-config-says-{layers}")
            tiny_llama(tok, layers=4).save_pretrained(folder)
            tok.save_pretrained(folder)
            with open(os.path.join(folder, "config.json")) as fh:
                config = json.load(fh)
            config["num_hidden_layers"] = layers
            with open(os.path.join(folder, "config.json"), "w") as fh:
                json.dump(config, fh)
            cfg, out = self.config(f"strict-{layers}", model={"policy": folder})
            self.record(
                "1",
                f"config.json says {layers} layers, the weights hold 4: lmppo train",
                self.lmppo(["train", cfg]),
                lambda c, ls: c == 2 and len(ls) == 1 and "model.strict: false" in ls[0],
            )

    def shuffled_prompts(self) -> None:
        prompts = os.path.join(self.work, "shuffled-prompts.txt")
        shutil.copy(self.prompts, prompts)
        cfg, out = self.config("shuffled", data={"prompts": prompts})
        self.lmppo(["train", cfg])
        with open(prompts) as fh:
            lines = fh.read().splitlines()
        with open(prompts, "w") as fh:
            fh.write("\n".join(reversed(lines)) + "\n")
        argv = ["train", "--resume", out, "--total_episodes", "12"]
        self.record("3", "prompt file shuffled in place, then --resume", self.lmppo(argv), _one_error("data.prompts"))
        self.record(
            "3",
            "the same with --accept-changed-inputs",
            self.lmppo([*argv, "--accept-changed-inputs"]),
            lambda c, ls: c == 0 and not ls,
        )

    def older_record(self) -> None:
        cfg, out = self.config("older-record")
        self.lmppo(["train", cfg])
        thesis = os.path.join(out, "final", "thesis.pdf")
        with open(thesis, "wb") as fh:
            fh.write(b"%PDF my thesis")
        record = os.path.join(out, ".lmppo-owned.json")
        with open(record) as fh:
            data = json.load(fh)
        with open(record, "w") as fh:
            json.dump({"files": data["files"]}, fh)  # an older lmppo's: no listing of final/
        result = self.lmppo(["train", cfg, "--overwrite", "true"])
        kept = os.path.isfile(thesis) and open(thesis, "rb").read() == b"%PDF my thesis"
        self.record("4", "record without final/ listing, --overwrite true", result, _warns("thesis.pdf"), kept)

    def read_only_eval(self) -> None:
        disk = self.mount("size=64m")
        if disk is None:
            return self.skip("5", "lmppo eval RUN on a read-only file system", "mounting needs root")
        cfg, _ = self.config("ro")
        run = os.path.join(disk, "run")
        self.lmppo(["train", cfg, "--output_dir", run])
        before = sorted(os.listdir(run))
        subprocess.run(["mount", "-o", "remount,ro", disk], check=True)
        result = self.lmppo(["eval", run, "--num-prompts", "2", "--samples-per-prompt", "1"])
        self.record(
            "5",
            "lmppo eval RUN, RUN on a read-only tmpfs",
            result,
            _one_error("read-only"),
            before == sorted(os.listdir(run)),
        )

    def read_only_cache(self) -> None:
        cache = self.mount("size=1m,ro")
        if cache is None:
            return self.skip("6", "read-only LMPPO_CACHE", "mounting needs root")
        argv = ["train", "--total_episodes", "32", "--output_dir", os.path.join(self.work, "ro-cache")]
        self.record(
            "6",
            "lmppo train (smollm2) with LMPPO_CACHE on a read-only tmpfs",
            self.lmppo(argv, LMPPO_CACHE=cache),
            _one_error("read-only"),
        )

    def merge_and_eval_signals(self) -> None:
        a, b = self.model_dir, self.second_model()
        output = os.path.join(self.work, "merged")
        for sig, code in ((signal.SIGTERM, 143), (signal.SIGINT, 130)):
            result = self.held("lmppo.apps.merge", "save_file", ["merge", a, b, "--output", output], [sig])
            left = [n for n in os.listdir(self.work) if n.startswith(".merged.")]
            self.record(
                "7/8",
                f"{signal.Signals(sig).name} during lmppo merge's write",
                result,
                lambda c, ls, code=code: c == code and len(ls) == 1 and "lmppo merge" in ls[0] and "train" not in ls[0],
                not left,
            )
        proc_result = self.held("lmppo.apps.merge", "save_file", ["merge", a, b, "--output", output], [signal.SIGKILL])
        left = [n for n in os.listdir(self.work) if n.startswith(".merged.tmp-")]
        again = self.lmppo(["merge", a, b, "--output", output])
        gone = not [n for n in os.listdir(self.work) if n.startswith(".merged.")]
        self.record(
            "7",
            f"SIGKILL during merge (left {len(left)} temporary), then merge again",
            again,
            lambda c, ls: c == 0 and proc_result[0] == -9,
            gone,
        )
        cfg, run = self.config("eval-run")
        self.lmppo(["train", cfg])
        result = self.held(
            "lmppo.evaluation.evaluate", "load_models", ["eval", run, "--num-prompts", "2"], [signal.SIGINT]
        )
        self.record(
            "8",
            "Ctrl-C during lmppo eval",
            result,
            lambda c, ls: c == 130 and len(ls) == 1 and "lmppo eval" in ls[0] and "train" not in ls[0],
        )

    def second_model(self) -> str:
        from conftest import tiny_llama
        from helpers_tokenizers import make_bpe_tokenizer

        folder = os.path.join(self.work, "model-seed-1")
        if not os.path.isdir(folder):
            tok = make_bpe_tokenizer()
            tiny_llama(tok, seed=1).save_pretrained(folder)
            tok.save_pretrained(folder)
        return folder

    def train_signals(self) -> None:
        cfg, out = self.config("startup")
        for sig, code in ((signal.SIGTERM, 143), (signal.SIGHUP, 129)):
            shutil.rmtree(out, ignore_errors=True)
            result = self.lmppo(["train", cfg], signal_after=0.7, sig=sig)
            self.record(
                "7",
                f"{signal.Signals(sig).name} 0.7 s after lmppo train starts",
                result,
                lambda c, ls, code=code: c == code and len(ls) == 1,
            )
        cfg, out = self.config("hup-ckpt", iterations=3)
        result = self.held("lmppo.run.checkpoint", "write_manifest", ["train", cfg], [signal.SIGHUP])
        self.record(
            "7",
            "SIGHUP during a checkpoint write (its manifest written, not yet published)",
            result,
            lambda c, ls: c == 129 and len(ls) == 1 and ("--resume" in ls[0] or "--overwrite true" in ls[0]),
        )
        resumable = "--resume" in "".join(result[1])
        advised = ["train", "--resume", out] if resumable else ["train", cfg, "--overwrite", "true"]
        self.record("7", f"what it advises: lmppo {' '.join(advised[1:])}", self.lmppo(advised), lambda c, ls: c == 0)
        cfg, out = self.config("double-ctrl-c", iterations=3)
        result = self.held(
            "lmppo.run.checkpoint", "write_manifest", ["train", cfg], [signal.SIGINT, signal.SIGINT], gap=0.02
        )
        self.record("11", "Ctrl-C, and again 20 ms later", result, lambda c, ls: c == 130 and len(ls) == 1)
        cfg, out = self.config("finished", iterations=1)
        result = self.lmppo(["train", cfg])
        self.record(
            "11",
            "a finished run: no .lmppo.lock left",
            result,
            lambda c, ls: c == 0 and not os.path.exists(os.path.join(out, ".lmppo.lock")),
        )

    def linked_checkpoints(self) -> None:
        big = os.path.join(self.work, "bigdisk-ckpts")
        os.makedirs(big)
        cfg, out = self.config("linked")
        os.makedirs(out)
        os.symlink(big, os.path.join(out, "checkpoints"))
        first = self.lmppo(["train", cfg])
        with open(os.path.join(big, "NOTES.txt"), "w") as fh:
            fh.write("mine")
        result = self.lmppo(["train", cfg, "--overwrite", "true"])
        kept = os.path.islink(os.path.join(out, "checkpoints")) and os.path.isfile(os.path.join(big, "NOTES.txt"))
        self.record(
            "9",
            "checkpoints/ linked to another disk: first run, then --overwrite true",
            result,
            lambda c, ls: first[0] == 0 and c == 0,
            kept,
        )

    def moved_model(self) -> None:
        first = os.path.join(self.work, "policy-v1")
        shutil.copytree(self.model_dir, first)
        cfg, out = self.config("moved", model={"policy": first})
        self.lmppo(["train", cfg])
        moved = os.path.join(self.work, "elsewhere-policy")
        os.rename(first, moved)
        argv = ["train", "--resume", out, "--total_episodes", "12", "--model.policy", moved]
        self.record(
            "10", "mv MODEL NEW; lmppo train --resume RUN --model.policy NEW", self.lmppo(argv), lambda c, ls: c == 0
        )

    def full_cache(self) -> None:
        cache = self.mount("size=48m")
        if cache is None:
            return self.skip("11", "cache full during the SmolLM2 conversion", "mounting needs root")
        argv = ["train", "--total_episodes", "32", "--output_dir", os.path.join(self.work, "full-cache")]
        self.record(
            "11",
            "LMPPO_CACHE on a 48 MB tmpfs: full during the SmolLM2 conversion",
            self.lmppo(argv, LMPPO_CACHE=cache),
            lambda c, ls: (
                c == 2
                and len([x for x in ls if x.startswith("error:")]) == 1
                and "disk is full" in ls[-1]
                and "SafetensorError" not in "".join(ls)
            ),
        )

    def huge_rewards(self) -> None:
        path = os.path.join(self.work, "huge.py")
        with open(path, "w") as fh:
            fh.write("def huge(p, c):\n    return [1e30 * (i + 1) for i in range(len(c))]\n")
        cfg, _ = self.config("huge", iterations=4, reward={"sources": [{"kind": "function", "path": path + ":huge"}]})
        self.record("11", "huge rewards (1e30)", self.lmppo(["train", cfg]), _one_error("non-finite"))

    def run(self) -> int:
        try:
            for case in (
                self.strict_loads,
                self.shuffled_prompts,
                self.older_record,
                self.read_only_eval,
                self.read_only_cache,
                self.train_signals,
                self.merge_and_eval_signals,
                self.linked_checkpoints,
                self.moved_model,
                self.full_cache,
                self.huge_rewards,
            ):
                case()
        finally:
            for mnt in self.mounts:
                subprocess.run(["umount", "-l", mnt], capture_output=True)
        for row in self.rows:
            verdict = "ok" if row["ok"] else "FAILED"
            print(f"case {row['case']:>3} | {row['what']}: rc {row['rc']} | user's files kept {row['kept']} {verdict}")
            for line in row["lines"]:
                print(f"           {line}")
        bad = [r for r in self.rows if not r["ok"]]
        print(f"{len(self.rows) - len(bad)}/{len(self.rows)} cases ended as they must")
        return 1 if bad else 0


def _ctrl_c_as_in_a_terminal() -> None:
    """A shell starts background jobs with SIGINT ignored, and Python keeps it so: the child gets it back."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _one_error(word: str) -> Callable[[int, list[str]], bool]:
    return lambda c, ls: c == 2 and len(ls) == 1 and ls[0].startswith("error: ") and word in ls[0]


def _warns(name: str) -> Callable[[int, list[str]], bool]:
    return lambda c, ls: c == 0 and any(name in ln and ln.startswith("warning: ") for ln in ls)


def run_cases(work: str, model_dir: str, prompts: str, reward: str) -> int:
    return Cases(work, model_dir, prompts, reward).run()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", default=None)
    return main_in(parser.parse_args().work)


def main_in(work: Optional[str]) -> int:
    """The cases in folder `work` (default: a new temporary folder)."""
    sys.path.insert(0, str(HERE.parents[1] / "shared"))
    import bench_path

    bench_path.put_first(bench_path.TESTS, bench_path.SRC)
    from conftest import tiny_llama
    from helpers_tokenizers import make_bpe_tokenizer

    work = work or tempfile.mkdtemp(prefix="lmppo-cases-")
    os.makedirs(work, exist_ok=True)
    tok = make_bpe_tokenizer()
    model_dir = os.path.join(work, "model")
    if not os.path.isdir(model_dir):
        tiny_llama(tok).save_pretrained(model_dir)
        tok.save_pretrained(model_dir)
    prompts = os.path.join(work, "prompts.txt")
    with open(prompts, "w") as fh:
        fh.write("the movie was\nthis film is\nmy friend felt\nthe story seemed\n")
    reward = os.path.join(work, "reward.py")
    with open(reward, "w") as fh:
        fh.write("def ok(prompts, completions):\n    return [len(c) / 20.0 for c in completions]\n")
    return run_cases(work, model_dir, prompts, reward + ":ok")


if __name__ == "__main__":
    sys.exit(main())
