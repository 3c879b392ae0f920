"""Fault injection: random SIGKILLs, SIGTERMs, SIGHUPs and full-disk moments during real `lmppo train` runs.

    python benchmarks/tools/fault_injection.py [--kills 20] [--terms 0] [--hups 0] [--disk 20] [--iterations 10]
        [--seed 0] [--work DIR]
    python benchmarks/tools/fault_injection.py --deepspeed zero2 --nproc 2 --kills 5 --disk 0 [--iterations 6]

Each run is the real command (`lmppo.apps.cli.main(["train", ...])`) in a separate process, forked from this warm
process (so a run does not pay for importing torch again), on a tiny Llama saved as a model folder, with a
checkpoint after every iteration (keep_last 2) and a sample table every iteration.

- Reference: one uninterrupted run; its last checkpoint's weights and optimizer state, and its metrics
  (wall-clock fields aside), are what every other run must end with.
- Moments: a fault comes during start-up (model loading; probability 1/(remaining iterations + 1)) or at a
  uniformly random time within a uniformly chosen remaining iteration, its checkpoint write included (found by
  watching the run's metrics.jsonl, so the draw does not depend on the machine's speed).
- SIGKILL trials: a run is started and killed with SIGKILL at a random moment, then resumed (`--resume`; a run
  killed before its first checkpoint is started again with `overwrite: true`), each resume again killed with
  probability 1/2, until one finishes. Counted: kills, kills that left a checkpoint write in progress (a
  `.iter-N.tmp` folder), runs that end bit-identical to the reference, runs with a lost, duplicated or torn
  metrics row, runs with a temporary (`lmppo.run.storage.temporaries`) left in the folder at the end.
- SIGTERM trials (`--terms N`) and SIGHUP trials (`--hups N`, a closed terminal or ssh session): the same with
  that signal; besides, every signalled process must exit 128 + N (143, 129) with one line giving a command that
  works (`--resume`, or `--overwrite true` before the first checkpoint) and must have removed its own temporaries.
  Results: docs/robustness.md.
- Full-disk trials: the run writes into a small tmpfs (needs root to mount; skipped otherwise with the
  reason). At a random moment a real filler file takes all free space, or all but a random 0-128 KiB. The run
  must finish (the fault came too late or left room) or exit 2 with exactly one `error:` line that names the
  full disk, with no temporary file left behind; then the filler is removed and `--resume` must finish
  bit-identical to the reference.

Under DeepSpeed (`--deepspeed zero2|zero3 --nproc N`) every run is `torchrun --standalone --nproc_per_node N -m
lmppo.apps.cli train ...` (a cold start each time), a kill is SIGKILL to torchrun and every worker at once (as when the
machine dies), and what must be bit-identical is the final model, every tensor of the last checkpoint's DeepSpeed
shards and the metrics rows. Full-disk trials are not run in this mode.

`--cases` runs the cases of issue 41 instead, each produced for real (benchmarks/tools/fault_cases.py).

Prints the figures; exit code 1 when any trial broke a promise.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))  # benchmarks/shared: bench_path
import bench_path  # noqa: E402  (every benchmark folder on the path)

ROOT = str(bench_path.ROOT)
bench_path.put_first(bench_path.TESTS, bench_path.SRC)

from lmppo.run import storage  # noqa: E402  (after the path set-up)

WALL_CLOCK = ("eps", "tokens_per_s")
REWARD = "def length(prompts, completions):\n    return [len(c) / 20.0 for c in completions]\n"
PROMPTS = [
    "the movie was",
    "this film is",
    "my friend felt",
    "the story seemed",
    "a critic said",
    "the ending was",
    "the actor looked",
    "we left early because",
]


def setup(work: str, iterations: int, deepspeed: str = "") -> dict:
    import torch
    import yaml

    from conftest import tiny_llama
    from helpers_tokenizers import make_bpe_tokenizer

    tok = make_bpe_tokenizer()
    model_dir = os.path.join(work, "model")
    if not os.path.isdir(model_dir):
        tiny_llama(tok).save_pretrained(model_dir)
        tok.save_pretrained(model_dir)
    with open(os.path.join(work, "prompts.txt"), "w") as fh:
        fh.write("\n".join(PROMPTS) + "\n")
    with open(os.path.join(work, "reward.py"), "w") as fh:
        fh.write(REWARD)
    base = {
        "total_episodes": 8 * iterations,
        "seed": 0,
        "precision": "fp32",
        "model": {"policy": model_dir},
        "data": {"prompts": os.path.join(work, "prompts.txt"), "holdout": 0},
        "rollout": {"batch_size": 8, "max_new_tokens": 6, "temperature": 1.0},
        "reward": {"sources": [{"kind": "function", "path": os.path.join(work, "reward.py") + ":length"}]},
        "ppo": {"num_epochs": 2, "num_minibatches": 2, "micro_batch_size": 2, "learning_rate": 1e-3},
        "log": {"trackers": [], "sample_every": 1, "num_samples": 2, "progress": False},
        "checkpoint": {"every": 1, "keep_last": 2},
    }
    if deepspeed:
        base.update(deepspeed=deepspeed, device="cpu")
    torch.set_num_threads(1)

    def config_for(out: str, path: str = "") -> str:
        path = path or out.rstrip("/") + ".yaml"
        with open(path, "w") as fh:
            yaml.safe_dump({**base, "output_dir": out}, fh)
        return path

    return {"config_for": config_for, "iterations": iterations}


def fork_cli(argv: list[str], log: str) -> int:
    """A child process running the real `lmppo` command; its stderr goes to `log`."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 2)
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1)
            sys.stderr = open(2, "w", closefd=False)
            sys.stdout = open(1, "w", closefd=False)
            from lmppo.apps.cli import main

            code = main(argv)
        except SystemExit as err:
            code = err.code if isinstance(err.code, int) else 1
        except BaseException:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            code = 1
        finally:
            try:
                sys.stderr.flush()
            except Exception:  # noqa: BLE001
                pass
            os._exit(code)
    return pid


_reaped: dict[int, int] = {}  # pid -> wait status of children reaped while watching their progress


def wait(pid: int) -> int:
    status = _reaped.pop(pid, None)
    if status is None:
        _, status = os.waitpid(pid, 0)
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else -os.WTERMSIG(status)


class ForkedRun:
    """A run forked from this warm process (one process)."""

    def __init__(self, argv: list[str], log: str):
        self.pid = fork_cli(argv, log)

    def running(self) -> bool:
        if self.pid in _reaped:
            return False
        done, status = os.waitpid(self.pid, os.WNOHANG)
        if done:
            _reaped[self.pid] = status
        return not done

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.pid not in _reaped:  # still running (or a zombie): ours to kill
            os.kill(self.pid, sig)

    def wait(self) -> int:
        return wait(self.pid)


class TorchrunRun:
    """A run under `torchrun --nproc_per_node N` (DeepSpeed); killed with its workers, which torchrun starts in
    sessions of their own."""

    nproc = 2

    def __init__(self, argv: list[str], log: str):
        torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or "torchrun"
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH", "")]),
        }
        with open(log, "w") as fh:
            self.proc = subprocess.Popen(
                [torchrun, "--standalone", "--nproc_per_node", str(self.nproc), "-m", "lmppo.apps.cli", *argv],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=fh,
            )

    def running(self) -> bool:
        return self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        for pid in process_tree(self.proc.pid) if sig == signal.SIGKILL else [self.proc.pid]:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def wait(self) -> int:
        return self.proc.wait()


def process_tree(pid: int) -> list[int]:
    """`pid` and every process below it."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as fh:
                    todo += [int(c) for c in fh.read().split()]
        except OSError:
            continue
    return found


Run = ForkedRun  # TorchrunRun with --deepspeed


def outcome(out: str, iterations: int) -> dict:
    """What a finished run ends with: hashes of its last checkpoint's tensors, and its metrics rows."""
    import torch
    from safetensors.torch import load_file

    ckpt = os.path.join(out, "checkpoints", f"iter-{iterations:08d}")
    h = hashlib.sha256()
    if os.path.isdir(os.path.join(ckpt, "deepspeed")):
        _hash_sharded(h, out, ckpt)
        return {"weights": h.hexdigest(), **_rows(out)}
    trained = load_file(os.path.join(ckpt, "trained.safetensors"))
    for name in sorted(trained):
        h.update(name.encode())
        h.update(trained[name].reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    opt = torch.load(os.path.join(ckpt, "optimizer.pt"), weights_only=True)
    for index in sorted(opt["state"]):
        for key in sorted(opt["state"][index]):
            value = opt["state"][index][key]
            h.update(f"{index}/{key}".encode())
            h.update(
                value.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
                if isinstance(value, torch.Tensor)
                else repr(value).encode()
            )
    return {"weights": h.hexdigest(), **_rows(out)}


def _hash_sharded(h, out: str, ckpt: str) -> None:
    """The final model's tensors, every tensor of the checkpoint's DeepSpeed files (its own pickles) and the fp32
    weights DeepSpeed's zero_to_fp32 rebuilds from them into `h`."""
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file

    def add(obj, key: str) -> None:
        if "fp32_flat_groups" in key or "single_partition_of_fp32_groups" in key:
            return  # padded partitions (the padding holds whatever memory held): rebuilt by zero_to_fp32 below
        if isinstance(obj, torch.Tensor):
            h.update(key.encode())
            h.update(obj.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        elif isinstance(obj, dict):
            for k in sorted(obj, key=str):
                add(obj[k], f"{key}/{k}")
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                add(v, f"{key}/{i}")

    final = os.path.join(out, "final")
    for top, dirs, names in sorted(os.walk(final)):
        dirs.sort()
        for name in sorted(names):
            if name.endswith(".safetensors"):
                add(load_file(os.path.join(top, name)), os.path.relpath(os.path.join(top, name), final))
    for name in sorted(os.listdir(os.path.join(ckpt, "deepspeed"))):
        if name.endswith(".pt"):
            add(torch.load(os.path.join(ckpt, "deepspeed", name), map_location="cpu", weights_only=False), name)
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
        full = get_fp32_state_dict_from_zero_checkpoint(ckpt, tag="deepspeed")  # (prints its progress)
    add(full, "fp32 weights")


def _rows(out: str) -> dict:
    with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as fh:
        text = fh.read()
    torn = bool(text) and not text.endswith("\n")
    rows = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            torn = True
            continue
        rows.append({k: v for k, v in row.items() if k not in WALL_CLOCK and not k.startswith("time/")})
    return {"rows": rows, "torn": torn}


def stderr_lines(log: str) -> list[str]:
    with open(log, encoding="utf-8", errors="replace") as fh:
        return [ln for ln in fh.read().splitlines() if ln.strip()]


def run_to_end(argv: list[str], log: str) -> int:
    return Run(argv, log).wait()


def error_line(log: str) -> str:
    """The last `error:` line of a run's stderr ('' if none): the run's own message, whatever torchrun adds."""
    errors = [ln for ln in stderr_lines(log) if ln.startswith("error:")]
    return errors[-1] if errors else ""


def rows(out: str) -> int:
    try:
        with open(os.path.join(out, "metrics.jsonl"), "rb") as fh:
            return fh.read().count(b"\n")
    except OSError:
        return 0


def random_moment(run, out: str, iterations: int, timing: dict, rng: random.Random) -> None:
    """Return at a random point of the run `pid` writes into `out`: during start-up (loading, before the first
    iteration) with probability 1/(remaining iterations + 1), else a uniformly random time within a uniformly
    chosen remaining iteration (its checkpoint write included). Measured by the run's progress, not the clock,
    so it holds on a loaded machine."""
    done = rows(out)
    k = rng.randrange(0, max(iterations - done, 0) + 1)
    if k == 0:
        time.sleep(rng.uniform(0.0, timing["startup"]))
        return
    while rows(out) < done + k - 1:
        if not run.running():
            return
        time.sleep(0.005)
    time.sleep(rng.uniform(0.0, timing["iteration"]))


def kill_trials(
    ctx: dict, work: str, n: int, window: dict, reference: dict, rng: random.Random, sig: int = signal.SIGKILL
) -> dict:
    """`n` runs stopped by signal `sig` (SIGKILL or SIGTERM) at random moments and resumed until one finishes."""
    it = ctx["iterations"]
    name = signal.Signals(sig).name
    stats = {
        "signal": name,
        "trials": n,
        "kills": 0,
        "kills_in_checkpoint_write": 0,
        "identical": 0,
        "rows_ok": 0,
        "clean_exit": 0,
        "temporaries_after_signal": 0,
        "no_temporaries_at_end": 0,
        "messages": {},
        "failures": [],
    }
    for trial in range(n):
        out = os.path.join(work, f"{name.lower()}-{trial}")
        shutil.rmtree(out, ignore_errors=True)
        cfg = ctx["config_for"](out)
        log = out + ".log"
        argv = ["train", cfg]
        finished = False
        kill_next = True
        for _attempt in range(20):
            run = Run(argv, log)
            if kill_next:
                random_moment(run, out, it, window, rng)
                run.kill(sig)
            code = run.wait()
            if os.environ.get("FAULTS_DEBUG"):
                print(f"trial {trial}: {argv[1:]} exit {code}", file=sys.stderr)
            stopped = code in (-sig, 128 + sig) or (sig == signal.SIGINT and code == 130)
            if stopped:
                stats["kills"] += 1
                ckpts = os.path.join(out, "checkpoints")
                if os.path.isdir(ckpts) and any(n.endswith(".tmp") for n in os.listdir(ckpts)):
                    stats["kills_in_checkpoint_write"] += 1
                if sig != signal.SIGKILL:  # the process itself must clean up and say how to go on
                    lines = stderr_lines(log)
                    left = storage.temporaries(out) if os.path.isdir(out) else []
                    stats["temporaries_after_signal"] += bool(left)
                    advice = ("--resume" in lines[0] or "--overwrite true" in lines[0]) if lines else False
                    clean = code == 128 + sig and len(lines) == 1 and advice
                    if code == -sig:  # before the command installed its handler (start-up)
                        clean = not lines
                        key = "(killed during start-up, before the handler: no message)"
                    else:
                        key = re.sub(r"`lmppo train [^`]*`", "`lmppo train ...`", lines[-1] if lines else "(nothing)")
                    stats["messages"][key] = stats["messages"].get(key, 0) + 1
                    stats["clean_exit"] += clean
                    if not clean:
                        stats["failures"].append(f"trial {trial}: {name} exit {code}: {lines[-3:]}")
            elif code != 0:
                lines, error = stderr_lines(log), error_line(log)
                if "no complete checkpoint" in error:
                    argv = ["train", cfg, "--overwrite", "true"]  # stopped before its first checkpoint
                    kill_next = rng.random() < 0.5
                    continue
                if error.endswith(f"cannot resume from {out}: no such folder"):
                    argv = ["train", cfg]  # stopped before it made its output folder
                    kill_next = rng.random() < 0.5
                    continue
                stats["failures"].append(f"trial {trial}: exit {code}: {lines[-3:]}")
                break
            else:
                finished = True
                break
            argv = ["train", "--resume", out]
            kill_next = rng.random() < 0.5
        if not finished:
            if not stats["failures"] or not stats["failures"][-1].startswith(f"trial {trial}:"):
                stats["failures"].append(f"trial {trial}: did not finish")
            continue
        got = outcome(out, it)
        left = storage.temporaries(out)
        stats["no_temporaries_at_end"] += not left
        if left:
            stats["failures"].append(f"trial {trial}: temporaries left at the end: {left}")
        stats["identical"] += got["weights"] == reference["weights"] and got["rows"] == reference["rows"]
        stats["rows_ok"] += (not got["torn"]) and [r["iteration"] for r in got["rows"]] == list(range(1, it + 1))
        if got["weights"] != reference["weights"] or got["rows"] != reference["rows"]:
            stats["failures"].append(f"trial {trial}: ended differently from the uninterrupted run")
        shutil.rmtree(out, ignore_errors=True)
    return stats


def print_kills(stats: dict) -> None:
    n = stats["trials"]
    print(
        f"{stats['signal']}: {n} runs, {stats['kills']} signals ({stats['kills_in_checkpoint_write']} left a "
        f"checkpoint write in progress); bit-identical to the uninterrupted run: {stats['identical']}/{n}; "
        f"metrics without a lost, duplicated or torn row: {stats['rows_ok']}/{n}; no temporary left at the end: "
        f"{stats['no_temporaries_at_end']}/{n}"
    )
    if stats["signal"] != "SIGKILL":
        print(
            f"  exit {128 + signal.Signals[stats['signal']].value} with one line saying how to resume: "
            f"{stats['clean_exit']}/{stats['kills']}; temporaries "
            f"left right after the signalled process exited: {stats['temporaries_after_signal']}/{stats['kills']}"
        )
        for key, count in sorted(stats["messages"].items(), key=lambda kv: -kv[1]):
            print(f"  {count:3d} x {key}")


def mount_tmpfs(path: str, size: str) -> str:
    os.makedirs(path, exist_ok=True)
    if os.geteuid() != 0:
        return "not root: cannot mount a tmpfs"
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], capture_output=True, text=True)
    return "" if done.returncode == 0 else f"mount failed: {done.stderr.strip()}"


def fill(disk: str, leave: int) -> None:
    st = os.statvfs(disk)
    free = st.f_bavail * st.f_frsize
    fd = os.open(os.path.join(disk, "filler"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        todo = max(free - leave, 0)
        block = b"\0" * (1 << 20)
        while todo > 0:
            todo -= os.write(fd, block[: min(todo, len(block))])
    except OSError:
        pass  # full already
    finally:
        os.close(fd)


def disk_trials(ctx: dict, work: str, n: int, window: dict, reference: dict, rng: random.Random) -> dict:
    it = ctx["iterations"]
    stats = {
        "trials": n,
        "hit": 0,
        "finished_anyway": 0,
        "clean_message": 0,
        "no_temporaries": 0,
        "resumed_identical": 0,
        "failures": [],
        "messages": {},
    }
    disk = os.path.join(work, "disk")
    why = mount_tmpfs(disk, "32m")
    if why:
        stats["skipped"] = why
        return stats
    try:
        for trial in range(n):
            for name in os.listdir(disk):
                path = os.path.join(disk, name)
                shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)
            out = os.path.join(disk, "run")
            cfg = ctx["config_for"](out, os.path.join(work, f"disk-{trial}.yaml"))
            log = os.path.join(work, f"disk-{trial}.log")
            run = Run(["train", cfg], log)
            random_moment(run, out, it, window, rng)
            fill(disk, rng.choice([0, rng.randrange(0, 128 * 1024)]))
            code = run.wait()
            lines = stderr_lines(log)
            if code == 0:
                stats["finished_anyway"] += 1
            else:
                stats["hit"] += 1
                clean = code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "disk is full" in lines[0]
                stats["clean_message"] += clean
                if not clean:
                    stats["failures"].append(f"disk trial {trial}: exit {code}: {lines[-5:]}")
                else:
                    key = re.sub(r"iteration \d+", "iteration N", lines[0].split(" to ")[0])
                    stats["messages"][key] = stats["messages"].get(key, 0) + 1
                left = storage.temporaries(out)
                stats["no_temporaries"] += not left
                if left:
                    stats["failures"].append(f"disk trial {trial}: left {left}")
            os.unlink(os.path.join(disk, "filler"))
            if code != 0:
                again = run_to_end(["train", "--resume", out], log + ".resume")
                if again == 2 and "no complete checkpoint" in " ".join(stderr_lines(log + ".resume")):
                    again = run_to_end(["train", cfg, "--overwrite", "true"], log + ".resume")
                if again != 0:
                    stats["failures"].append(
                        f"disk trial {trial}: resume exit {again}: {stderr_lines(log + '.resume')[-3:]}"
                    )
                    continue
            got = outcome(out, it)
            if code != 0:
                same = got["weights"] == reference["weights"] and got["rows"] == reference["rows"]
                stats["resumed_identical"] += same
                if not same:
                    stats["failures"].append(f"disk trial {trial}: resumed run differs from the uninterrupted run")
    finally:
        subprocess.run(["umount", "-l", disk], capture_output=True)
    return stats


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--terms", type=int, default=0, help="trials stopped by SIGTERM (beside the SIGKILL ones)")
    parser.add_argument("--hups", type=int, default=0, help="trials stopped by SIGHUP")
    parser.add_argument("--cases", action="store_true", help="run the cases of issue 41 only (fault_cases.py)")
    parser.add_argument("--disk", type=int, default=20)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", default=None)
    parser.add_argument(
        "--deepspeed",
        default="",
        choices=["", "zero2", "zero3"],
        help="run every training under torchrun with DeepSpeed at this ZeRO stage",
    )
    parser.add_argument("--nproc", type=int, default=2, help="processes per run under --deepspeed")
    args = parser.parse_args()
    if args.cases:
        import fault_cases

        return fault_cases.main_in(args.work)
    global Run
    if args.deepspeed:
        Run, TorchrunRun.nproc = TorchrunRun, args.nproc
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    work = args.work or tempfile.mkdtemp(prefix="lmppo-faults-")
    os.makedirs(work, exist_ok=True)
    ctx = setup(work, args.iterations, args.deepspeed)
    import lmppo.apps.train  # noqa: F401  (warm: forked runs start with everything imported)
    import lmppo.training.trainer  # noqa: F401

    warm = os.path.join(work, "warm-up")  # the first run fills caches (precision probe, ...): not timed
    shutil.rmtree(warm, ignore_errors=True)
    if run_to_end(["train", ctx["config_for"](warm)], warm + ".log") != 0:
        print("the warm-up run failed:", stderr_lines(warm + ".log")[-5:])
        return 1
    ref_out = os.path.join(work, "reference")
    shutil.rmtree(ref_out, ignore_errors=True)
    start = time.monotonic()
    run = Run(["train", ctx["config_for"](ref_out)], ref_out + ".log")
    first = None
    metrics = os.path.join(ref_out, "metrics.jsonl")
    while True:
        running = run.running()
        if first is None and os.path.isfile(metrics) and os.path.getsize(metrics) > 0:
            first = time.monotonic() - start
        if not running:
            break
        time.sleep(0.01)
    code = run.wait()
    duration = time.monotonic() - start
    first = first or 0.0
    window = {"startup": first, "iteration": (duration - first) / max(args.iterations - 1, 1)}
    if code != 0:
        print("the reference run failed:", stderr_lines(ref_out + ".log")[-5:])
        return 1
    reference = outcome(ref_out, args.iterations)
    if outcome(warm, args.iterations) != reference:
        print("two uninterrupted runs differ: the comparison below would mean nothing")
        return 1
    if args.deepspeed:
        print(f"under torchrun, DeepSpeed {args.deepspeed}, {args.nproc} processes (gloo, CPU)")
    print(
        f"reference run: {args.iterations} iterations in {duration:.1f} s, the first logged after {first:.1f} s; "
        "each kill or full disk comes at a random point: during start-up, or within a uniformly chosen "
        "remaining iteration (its checkpoint write included)"
    )
    rng = random.Random(args.seed)
    kills = kill_trials(ctx, work, args.kills, window, reference, rng) if args.kills else None
    if kills:
        print_kills(kills)
    terms = kill_trials(ctx, work, args.terms, window, reference, rng, signal.SIGTERM) if args.terms else None
    if terms:
        print_kills(terms)
    hups = kill_trials(ctx, work, args.hups, window, reference, rng, signal.SIGHUP) if args.hups else None
    if hups:
        print_kills(hups)
    disk = (
        disk_trials(ctx, work, args.disk, window, reference, rng)
        if args.disk
        else {"skipped": "--disk 0", "failures": []}
    )
    if "skipped" in disk:
        print(f"full disk: skipped ({disk['skipped']})")
    else:
        print(
            f"full disk: {disk['trials']} runs, {disk['hit']} hit by the full disk ({disk['finished_anyway']} "
            f"finished anyway: the fault came after the last write or left room); one clean `error:` line: "
            f"{disk['clean_message']}/{disk['hit']}; no temporary file left: {disk['no_temporaries']}/{disk['hit']}; "
            f"resumed bit-identical: {disk['resumed_identical']}/{disk['hit']}"
        )
        for key, count in sorted(disk["messages"].items(), key=lambda kv: -kv[1]):
            print(f"  {count:3d} x {key} ...")
    failures = [f for stats in (kills, terms, hups) for f in (stats or {}).get("failures", [])] + disk["failures"]
    for line in failures:
        print("FAILED", line)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
