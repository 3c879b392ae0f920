"""A training process with an environment, for tests/training/test_episode_resume.py: `env_worker.py OUT ENV [resume]`.

Trains a tiny in-process policy for 4 iterations on multi-turn episodes (a checkpoint every iteration). With
WORKER_MARKER set, it writes that file after iteration 2 and carries on slowly (a 0.5 s pause after each
micro-step of the next iterations), so the test can SIGKILL it in the middle of iteration 3. WORKER_ON_ERROR sets
environment.on_error."""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

ROWS = [{"prompt": f"count down from {n}", "turns": n, "per_word": 0.1} for n in (1, 2, 3, 5, 2, 4, 1, 3)]


def config(out: str, env: str):
    from conftest import small_config

    cfg = small_config(
        out,
        iterations=4,
        batch=4,
        environment__path=env,
        environment__max_turns=3,
        rollout__stop_token="<|im_end|>",
        ppo__micro_batch_size=2,
        checkpoint__every=1,
        checkpoint__keep_last=4,
        environment__on_error=os.environ.get("WORKER_ON_ERROR", "stop"),
    )
    cfg.reward.sources = []
    return cfg


class Marker:
    def __init__(self, path: str):
        self.path = path

    def on_iteration_end(self, trainer, metrics) -> None:
        if trainer.iteration == 2:
            with open(self.path, "w") as fh:
                fh.write("2")
        if trainer.iteration >= 2:
            time.sleep(0.5)

    def on_log(self, trainer, metrics) -> None:
        if trainer.iteration >= 2:
            time.sleep(0.5)


def main() -> None:
    from conftest import tiny_llama
    from helpers_tokenizers import make_bpe_tokenizer
    from lmppo.training.trainer import PPOTrainer

    out, env = sys.argv[1], sys.argv[2]
    tokenizer = make_bpe_tokenizer()
    objects = dict(policy=tiny_llama(tokenizer), tokenizer=tokenizer, prompts=list(ROWS))
    marker = os.environ.get("WORKER_MARKER")
    callbacks = [Marker(marker)] if marker else None
    if len(sys.argv) > 3 and sys.argv[3] == "resume":
        trainer = PPOTrainer.resume(out, **objects)
    else:
        trainer = PPOTrainer(config(out, env), callbacks=callbacks, **objects)
    trainer.train()


if __name__ == "__main__":
    main()
