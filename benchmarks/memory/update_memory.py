"""Peak memory of the PPO update (phase 5) of one real iteration, with a separate critic's backward before the
policy's pass (lmppo's way, `Updater.critic_backward_first`) or one backward for both, and with
`model.gradient_checkpointing`.

Each variant runs in a fresh subprocess: `lmppo train` of one iteration of an agents.py run (`--task`, `--side`,
`--seed`: the same config as benchmarks/learning/agents.py writes, SmolLM2-135M-Instruct with LoRA in fp32), the
same seed so every variant updates on the same rollout. Just before the update the resident set's high-water mark
is reset (`/proc/self/clear_refs`); printed: the resident size then, the peak during the update (VmHWM) and the rise,
for each variant, and the ratios against one backward for both. Linux only (it reads /proc).

    python benchmarks/memory/update_memory.py [--task textarena:GuessTheNumber-v0-hardcore] [--seed 1]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "learning"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))

VARIANTS = {
    "one backward": {"backward_first": False, "checkpointing": False},
    "critic backward first": {"backward_first": True, "checkpointing": False},
    "critic first + checkpointing": {"backward_first": True, "checkpointing": True},
}


def _status_gib(field: str) -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 2**20
    raise RuntimeError(f"{field} not in /proc/self/status")


def run_variant(config_path: str, backward_first: bool) -> dict:
    import yaml

    from lmppo.config import Config
    from lmppo.config.fields import from_dict
    from lmppo.training.trainer import PPOTrainer

    with open(config_path) as fh:
        cfg = from_dict(Config, yaml.safe_load(fh))
    trainer = PPOTrainer(cfg)
    updater = trainer.updater
    updater.critic_backward_first = backward_first and updater.critic_backward_first
    measured: dict = {}
    update = updater.update

    def measured_update(*args, **kwargs):
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # VmHWM := the current resident size
        measured["before_gib"] = _status_gib("VmRSS")
        update(*args, **kwargs)
        measured["peak_gib"] = _status_gib("VmHWM")

    updater.update = measured_update
    trainer.train()
    measured["rise_gib"] = measured["peak_gib"] - measured["before_gib"]
    return measured


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", default="textarena:GuessTheNumber-v0-hardcore")
    p.add_argument("--side", default="ppo_critic")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--variant", choices=list(VARIANTS), help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args.config, VARIANTS[args.variant]["backward_first"])))
        return
    import yaml
    from agents import run_config
    from side_by_side import model_dir

    model = model_dir(sys.executable)

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    rows = {}
    with tempfile.TemporaryDirectory() as work:
        for name, variant in VARIANTS.items():
            config = run_config(
                task=args.task,
                side=args.side,
                seed=args.seed,
                episodes=16,  # one iteration
                heldout=1,
                model=model,
                run_dir=os.path.join(work, name.replace(" ", "_")),
                extra={"model.gradient_checkpointing": variant["checkpointing"]},
            )
            path = os.path.join(work, name.replace(" ", "_") + ".yaml")
            with open(path, "w") as fh:
                yaml.safe_dump(config, fh)
            cmd = [sys.executable, __file__, "--variant", name, "--config", path]
            out = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if out.returncode:
                sys.exit(f"error: the variant {name!r} failed:\n{out.stderr[-2000:]}")
            rows[name] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"{args.task}, {args.side}, seed {args.seed}: the update of one iteration (16 episodes), fp32, CPU")
    base = rows["one backward"]["rise_gib"]
    for name, r in rows.items():
        print(
            f"  {name:29}: before the update {r['before_gib']:5.2f} GiB, peak {r['peak_gib']:5.2f} GiB, "
            f"rise {r['rise_gib']:5.2f} GiB, one backward / this: {base / max(r['rise_gib'], 1e-9):.2f}"
        )


if __name__ == "__main__":
    main()
