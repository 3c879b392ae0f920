"""A tiny-model training run that tests launch as a subprocess (and kill), plus the helpers they share.

    python tests/train_worker.py OUTPUT_DIR ITERATIONS [--resume] [--stall WHERE:ITERATION]
    python tests/train_worker.py --serve     (a zygote: see `serve`)

Trains the tiny Llama of conftest on PROMPTS with a deterministic length reward, a checkpoint after every
iteration. With `--stall WHERE:N` the worker writes the file named by $WORKER_MARKER (content `WHERE N`) and
sleeps forever at that point of iteration N, for the test to SIGKILL it there:

- `reward:N`   in the middle of iteration N (responses sampled, reward being computed, no update yet);
- `write:N`    inside the checkpoint write of iteration N: some files written, no manifest yet;
- `publish:N`  the checkpoint of iteration N complete in its temporary folder, not yet renamed into place;
- `prune:N`    the checkpoint of iteration N renamed into place, older ones not yet pruned.

It writes `$WORKER_MARKER.started` once the trainer is built (for kills at random moments).
"""

from __future__ import annotations

import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))

BATCH = 8
WALL_CLOCK = ("eps", "tokens_per_s")


def length_reward(prompts, completions):
    return [len(c) / 20.0 for c in completions]


def make_config(output_dir: str, iterations: int = 4, **fields):
    """A small, fast config (tests/conftest.py `small_config`): batch 8, 6 new tokens, 2 minibatches of 2
    micro-batches, 2 epochs; `fields` as dotted names with `__` (value__mode="critic")."""
    from conftest import small_config

    return small_config(output_dir, iterations, BATCH, **fields)


def api_objects(tokenizer, reward=length_reward) -> dict:
    """What a run passes besides its config: a fresh tiny policy (seed 0), the tokenizer, prompts, reward."""
    from conftest import PROMPTS, tiny_llama

    return {
        "policy": tiny_llama(tokenizer),
        "tokenizer": tokenizer,
        "prompts": list(PROMPTS),
        "reward_functions": {"length": reward},
    }


def comparable(metrics: dict) -> dict:
    """A metrics row without its wall-clock fields."""
    return {k: v for k, v in metrics.items() if k not in WALL_CLOCK and not k.startswith("time/")}


def read_jsonl(path: str) -> list[dict]:
    import json

    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _stall(where: str) -> None:
    marker = os.environ.get("WORKER_MARKER")
    if marker:
        with open(marker + ".tmp", "w") as fh:
            fh.write(where)
        os.replace(marker + ".tmp", marker)
    while True:
        time.sleep(60)


def main(argv: list[str]) -> int:
    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out, iterations = argv[0], int(argv[1])
    resume = "--resume" in argv
    where, at = "", -1
    if "--stall" in argv:
        where, n = argv[argv.index("--stall") + 1].split(":")
        at = int(n)

    import lmppo.run.checkpoint as ck
    from helpers_tokenizers import make_bpe_tokenizer
    from lmppo.training.trainer import PPOTrainer

    holder: dict = {}

    def iteration_in_progress() -> int:
        return holder["trainer"].iteration + 1

    def reward(prompts, completions):
        if where == "reward" and iteration_in_progress() == at:
            _stall(f"reward {at}")
        return length_reward(prompts, completions)

    def patch(name: str, point: str, checkpoint_iteration: int = 0):
        original = getattr(ck, name)

        def wrapped(*args, **kwargs):
            if where == point and holder["trainer"].iteration == at:
                _stall(f"{point} {at}")
            return original(*args, **kwargs)

        setattr(ck, name, wrapped)

    patch("write_manifest", "write")
    patch("_publish", "publish")
    patch("prune_checkpoints", "prune")

    tokenizer = make_bpe_tokenizer()
    objects = api_objects(tokenizer, reward)
    if resume:
        trainer = PPOTrainer.resume(out, **objects)
    else:
        trainer = PPOTrainer(
            make_config(out, iterations, checkpoint__every=1, checkpoint__keep_last=2, log__sample_every=1), **objects
        )
    holder["trainer"] = trainer
    marker = os.environ.get("WORKER_MARKER")
    if marker:
        open(marker + ".started", "w").close()
    trainer.train()
    return 0


def serve() -> int:
    """Import everything once, then for each stdin line `run ARGS...` fork a training process (a child of this
    one, running `main(ARGS)`) and print its pid; `wait PID` prints its wait status. Forking from a warm process
    spares each run the seconds of importing torch and transformers; the child is still a separate process that
    a test kills with SIGKILL."""
    import shlex
    import traceback

    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import LlamaForCausalLM  # noqa: F401  (warm the imports the children need)

    import lmppo.run.checkpoint  # noqa: F401
    import lmppo.training.trainer  # noqa: F401
    from helpers_tokenizers import make_bpe_tokenizer

    make_bpe_tokenizer()
    print("ready", flush=True)
    for line in sys.stdin:
        command, *args = shlex.split(line)
        if command == "run":
            pid = os.fork()
            if pid == 0:
                code = 1
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, 1)  # stdout is the zygote's answer channel
                try:
                    code = main(args)
                except BaseException:  # noqa: BLE001 - report and exit the child, never return into the loop
                    traceback.print_exc()
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)
            print(pid, flush=True)
        elif command == "wait":
            _, status = os.waitpid(int(args[0]), 0)
            print(status, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(serve() if sys.argv[1:] == ["--serve"] else main(sys.argv[1:]))
