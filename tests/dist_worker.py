"""Run a tiny PPO training in one process of a (possibly multi-process) torchrun job; write its metrics.

Used by tests/test_distributed.py:  torchrun --nproc_per_node N tests/dist_worker.py OUT_JSON
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(1)

from conftest import PROMPTS, tiny_llama  # noqa: E402
from helpers_tokenizers import make_bpe_tokenizer  # noqa: E402
from lmppo.config import Config  # noqa: E402
from lmppo.training.trainer import PPOTrainer  # noqa: E402


def length_reward(prompts, completions):
    return [len(c) / 20.0 for c in completions]


def settled_or_length_reward(prompts, completions):
    """RETIRE_SETTLED=1: every group of the second half of PROMPTS scores 1.0 (settled), the others their lengths."""
    return [1.0 if p in PROMPTS[4:] else len(c) / 20.0 + sum(map(ord, c)) % 7 for p, c in zip(prompts, completions)]


class DrawnPrompts:
    """RETIRE_SETTLED=1: each process's drawn global batches and retired prompts, written next to OUT_JSON."""

    def __init__(self, out_path: str):
        self.out_path, self.batches = out_path, []

    def on_iteration_end(self, trainer, metrics):
        self.batches.append(list(trainer.stream.last_batch))
        rank = trainer.accelerator.process_index
        with open(f"{self.out_path}.rank{rank}.drawn.json", "w") as fh:
            json.dump({"batches": self.batches, "retired": sorted(trainer.stream.retired)}, fh)


class StopOnMainProcess:
    """STOP_AFTER=N: on_log (which runs on the main process only) calls stop() after iteration N."""

    def __init__(self, after: int):
        self.after = after

    def on_log(self, trainer, metrics):
        if metrics["iteration"] == self.after:
            trainer.stop()


class PoisonZeroPadding:
    """POISON_ZERO3_PADDING=1: before each checkpoint, NaN in the padding of every ZeRO-3 partition of this process
    (what uninitialised padding may hold); the checkpoint's finiteness check must read only the real elements."""

    def on_iteration_end(self, trainer, metrics):
        for p in trainer.actor.parameters():
            if hasattr(p, "ds_tensor"):
                shard = p.ds_tensor.data.reshape(-1)
                real = max(0, min(p.ds_numel - torch.distributed.get_rank() * shard.numel(), shard.numel()))
                shard[real:] = float("nan")


def main(out_path: str) -> None:
    tok = make_bpe_tokenizer()
    cfg = Config()
    cfg.precision = "fp32"  # the same numbers on every CPU (`auto` picks bf16 where it is native)
    cfg.output_dir = os.path.join(os.path.dirname(out_path), "run")
    cfg.device = "cpu"
    cfg.total_episodes = 3 * 8
    cfg.rollout.batch_size = 8
    cfg.rollout.max_new_tokens = 6
    cfg.rollout.temperature = 1.0
    cfg.ppo.num_minibatches = int(os.environ.get("NUM_MINIBATCHES", "1"))
    cfg.ppo.micro_batch_size = int(os.environ.get("MICRO_BATCH", "2"))
    cfg.ppo.num_epochs = 2
    cfg.ppo.learning_rate = 1e-3
    cfg.data.shuffle = True
    cfg.log.trackers = []
    cfg.log.sample_every = 0
    cfg.value.mode = os.environ.get("VALUE_MODE", "shared")
    cfg.deepspeed = os.environ.get("DEEPSPEED", "")  # zero2 / zero3: tests/test_deepspeed.py
    cfg.reference.mode = os.environ.get("REFERENCE_MODE", "frozen")
    cfg.reference.every = 1
    cfg.model.lora.enabled, cfg.model.lora.r = bool(os.environ.get("LORA")), 4
    retire = bool(os.environ.get("RETIRE_SETTLED"))
    if retire:  # the per-prompt difficulty filter: each process must retire the same prompts
        cfg.ppo.advantage_estimator, cfg.rollout.num_samples_per_prompt = "grpo", 2
        cfg.data.retire_settled_after, cfg.total_episodes = 1, 6 * 8
    if os.environ.get("GRPO_BATCH_SCALE"):  # ppo.grpo_scale batch (a std over processes), a sequence-mean loss
        cfg.ppo.advantage_estimator, cfg.rollout.num_samples_per_prompt = "grpo", 2
        cfg.ppo.grpo_scale, cfg.ppo.whiten_advantages, cfg.ppo.loss_aggregation = "batch", False, "sequence_mean"
    prompts: list = PROMPTS * 2
    rewards: list = [settled_or_length_reward if retire else length_reward]
    if os.environ.get("ENVIRONMENT"):  # multi-turn episodes (tests/countdown_env.py), a reward on every turn
        cfg.environment.path = os.path.join(os.path.dirname(__file__), "countdown_env.py:Countdown")
        cfg.environment.max_turns = 3
        cfg.environment.on_error = os.environ.get("ON_ERROR", "stop")
        cfg.rollout.stop_token = "<|im_end|>"
        cfg.reward.sources, rewards = [], []
        prompts = [{"prompt": f"count down from {n}", "turns": n, "per_word": 0.1} for n in (1, 2, 3, 5, 2, 4, 1, 3)]
        prompts = prompts * 2
    policy = tiny_llama(tok)
    if os.environ.get("POLICY_FROM_FOLDER"):  # loaded by the trainer (under ZeRO-3: partitioned by zero.Init)
        cfg.model.policy = os.path.join(os.path.dirname(out_path), f"policy-rank{os.environ.get('RANK', '0')}")
        policy.save_pretrained(cfg.model.policy)
        tok.save_pretrained(cfg.model.policy)
        policy = None
    trainer = PPOTrainer(
        cfg,
        policy=policy,
        tokenizer=tok,
        prompts=prompts,
        reward_functions=rewards or None,
        callbacks=([StopOnMainProcess(int(os.environ["STOP_AFTER"]))] if "STOP_AFTER" in os.environ else [])
        + ([PoisonZeroPadding()] if os.environ.get("POISON_ZERO3_PADDING") else [])
        + ([DrawnPrompts(out_path)] if retire else []),
    )
    history = trainer.train()
    if trainer.accelerator.is_main_process:
        with open(out_path, "w") as fh:
            json.dump(history, fh)
    zero = getattr(trainer.strategy, "zero", None)
    if os.environ.get("DEEPSPEED") and zero is None:  # asked for ZeRO and did not get it: say so, do not skip
        raise SystemExit(f"DEEPSPEED={os.environ['DEEPSPEED']} but the trainer's strategy has no ZeRO side")
    if zero is not None and trainer.accelerator.is_main_process:
        from lmppo.models.partition import is_partitioned  # what ZeRO did, checked by tests/distributed/test_zero.py

        ref = trainer.reference.model
        with open(out_path + ".zero.json", "w") as fh:
            json.dump(
                {
                    "stage": zero.stage,
                    "num_processes": trainer.accelerator.num_processes,
                    "policy_partitioned": is_partitioned(trainer.policy),
                    "reference_partitioned": ref is not None and is_partitioned(ref),
                },
                fh,
            )


if __name__ == "__main__":
    main(sys.argv[1])
