"""`lmppo reward-model` over 2 CPU processes (torchrun, gloo): each scores half of every batch and the strategy
averages the gradients, so the model is the one a single process trains on the same batches."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import tiny_llama

pytestmark = pytest.mark.slow  # real processes, each training a model

WORKER = """
import sys
import torch
torch.set_num_threads(1)
from lmppo import RewardModelConfig, train_reward_model
cfg = RewardModelConfig(output_dir=sys.argv[3], device="cpu", precision="fp32")
cfg.data.pairs, cfg.model.policy, cfg.data.holdout, cfg.log.trackers = sys.argv[1], sys.argv[2], 8, []
cfg.training.epochs, cfg.training.batch_size, cfg.training.learning_rate = 1, 8, 3e-3
cfg.model.lora.enabled = False
train_reward_model(cfg, say=lambda line: None)
"""


def test_two_processes_train_the_model_one_does(tmp_path, tokenizer):
    from safetensors.torch import load_file

    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    assert torchrun is not None, "torchrun is installed with torch"
    base = tmp_path / "base"
    tiny_llama(tokenizer).save_pretrained(base)
    tokenizer.save_pretrained(base)
    data = tmp_path / "pairs.jsonl"
    rows = [
        {"chosen": f"it was great {i}", "rejected": f"it was awful {i}", "margin": 0.1 * (i % 3)} for i in range(40)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    weights = {}
    for n in (1, 2):
        out = tmp_path / f"n{n}"
        command = [torchrun, "--standalone", "--nproc_per_node", str(n), str(worker), str(data), str(base), str(out)]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        weights[n] = load_file(out / "final" / "reward-model" / "model.safetensors")
    one, two = weights[1], weights[2]
    start = load_file(base / "model.safetensors")
    moved = [k for k in one if k in start and not torch.equal(one[k], start[k])]
    assert moved  # training changed the weights, so agreeing means the same steps
    assert set(one) == set(two) and all(torch.allclose(one[k], two[k], atol=1e-5) for k in one)
