"""lmppo.quiet: the Python API and the TRL drop-in print what the CLI prints, none of the libraries' noise. Each run is
a real subprocess (the settings are process-wide), its stdout and stderr read whole."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from conftest import PROMPTS
from trl_support import EXAMPLE, src_env

datasets = pytest.importorskip("datasets")

NOISE = (
    "FutureWarning",
    "DeprecationWarning",
    "Setting accelerator to CPU",  # DeepSpeed, when imported
    "Loading weights",  # transformers' from_pretrained bar
    "Writing model shards",  # transformers' save_pretrained bar
    "Generating train split",  # datasets, reading a Parquet file
)


def run(args: list[str], **env: str) -> str:
    done = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=600, env={**src_env(), **env}
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr


def test_library_deprecations_are_silenced_a_programs_own_are_not():
    code = textwrap.dedent(
        """
        import warnings
        from lmppo.quiet import quiet_libraries
        quiet_libraries()
        for module in ("transformers.training_args", "deepspeed", "lmppo.training.trainer", "my_program"):
            warnings.warn_explicit("deprecated in " + module, FutureWarning, "f.py", 1, module=module)
        """
    )
    out = run(["-c", code])
    assert "deprecated in my_program" in out
    assert not any(f"deprecated in {m}" in out for m in ("transformers", "deepspeed", "lmppo"))
    out = run(["-c", code], LMPPO_DEBUG="1")  # lmppo --debug: everything as the libraries print it
    assert "deprecated in transformers.training_args" in out


def test_a_python_api_run_prints_no_library_noise(tmp_path, tiny_model_dir):
    prompts = tmp_path / "prompts.parquet"
    datasets.Dataset.from_dict({"prompt": PROMPTS}).to_parquet(str(prompts))
    script = tmp_path / "api_run.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys

            from lmppo import Config, PPOTrainer

            policy, prompts, out = sys.argv[1:4]
            cfg = Config()
            cfg.model.policy, cfg.data.prompts, cfg.data.field, cfg.output_dir = policy, prompts, "prompt", out
            cfg.precision, cfg.total_episodes, cfg.rollout.batch_size, cfg.rollout.max_new_tokens = "fp32", 4, 4, 4
            cfg.ppo.micro_batch_size, cfg.ppo.num_epochs = 4, 1
            cfg.log.trackers, cfg.log.sample_every, cfg.log.progress = [], 0, False
            PPOTrainer(cfg, reward_functions=[lambda prompts, completions: [len(c) / 10 for c in completions]]).train()
            print("api run done")
            """
        )
    )
    out = run([str(script), tiny_model_dir, str(prompts), str(tmp_path / "out")])
    assert "api run done" in out and (tmp_path / "out" / "final" / "policy").is_dir()
    assert [n for n in NOISE if n in out] == []


def test_a_drop_in_run_prints_no_library_noise_and_one_warning(tmp_path):
    out = run(
        [
            str(EXAMPLE),
            *("--output_dir", str(tmp_path / "run"), "--use_cpu", "--report_to", "none", "--disable_tqdm", "true"),
            *("--per_device_train_batch_size", "4", "--total_episodes", "8", "--response_length", "4"),
            *("--num_ppo_epochs", "1", "--stop_token", "eos", "--local_rollout_forward_batch_size", "4"),
            *("--per_device_eval_batch_size", "2", "--num_sample_generations", "0", "--max_steps", "3"),
        ]
    )
    assert "updates logged: 2" in out and (tmp_path / "run" / "model.safetensors").is_file()
    assert [n for n in NOISE if n in out] == []
    assert out.count("lmppo.trl: PPOConfig fields set that change nothing") == 1
    assert "run length: max_steps=3 (" in out


def test_huge_rewards_end_with_lmppos_line_alone_not_torchs_scheduler_warning_first(tmp_path, tiny_model_dir):
    """Every update of an iteration skipped (non-finite loss): the schedule still steps once per iteration, and
    torch's "lr_scheduler.step() before optimizer.step()" warning used to print before lmppo's own error."""
    (tmp_path / "huge.py").write_text("def huge(p, c):\n    return [1e30 * (i + 1) for i in range(len(c))]\n")
    (tmp_path / "prompts.txt").write_text("\n".join(PROMPTS[:4]) + "\n")
    (tmp_path / "cfg.yaml").write_text(
        textwrap.dedent(f"""
            output_dir: {tmp_path / "run"}
            total_episodes: 16
            model: {{policy: {tiny_model_dir}}}
            precision: fp32
            data: {{prompts: {tmp_path / "prompts.txt"}}}
            rollout: {{batch_size: 4, max_new_tokens: 4, stop_token: none}}
            reward: {{sources: [{{kind: function, path: "{tmp_path / "huge.py"}:huge"}}]}}
            ppo: {{num_epochs: 1, micro_batch_size: 4}}
            log: {{trackers: [], sample_every: 0}}
        """)
    )
    done = subprocess.run(
        [sys.executable, "-m", "lmppo.apps.cli", "train", str(tmp_path / "cfg.yaml")],
        capture_output=True,
        text=True,
        timeout=600,
        env=src_env(),
    )
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert done.returncode == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: 3 updates in a row had a non-finite loss or gradient")
