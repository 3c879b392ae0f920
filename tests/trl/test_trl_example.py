"""TRL's own PPO example script (tests/trl/fixtures/README.md), its imports changed to lmppo.trl, runs with the
command line its docstring gives, on tiny models served from local folders of the Hub names it uses."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import tiny_llama
from trl_support import HERE, src_env

FIXTURE = HERE / "trl" / "fixtures" / "trl_ppo_example.py"
SHA256 = "6e6cd55adad921f52257ff3e914b51258157a5247916010129dc50eeb9662fa1"
DATASET = "trl-internal-testing/descriptiveness-sentiment-trl-style"
TOKENIZER_ID, MODEL_ID = (
    "EleutherAI/pythia-1b-deduped",
    "EleutherAI/pythia-160m",
)  # the docstring's; PPOConfig's default
SHORT = [
    *("--total_episodes", "128", "--response_length", "6", "--num_ppo_epochs", "1", "--num_sample_generations", "1"),
    "--use_cpu",
]
"""Appended after the docstring's flags (argparse keeps the last): 2 updates of 64 instead of 157, 6 new tokens;
`--use_cpu` as TrainingArguments (under TRL too) refuses its default bf16 on a machine without a GPU otherwise."""


def trl_script() -> str:
    path = Path(os.environ.get("LMPPO_TRL_PPO_EXAMPLE") or FIXTURE)
    if not path.is_file():
        pytest.skip(f"TRL's example script is not at {path} (tests/trl/fixtures/README.md says where it comes from)")
    text = path.read_text(encoding="utf-8")
    assert hashlib.sha256(text.encode()).hexdigest() == SHA256, f"{path} is not TRL's script of the README"
    return text


def with_lmppo_imports(text: str) -> str:
    """The script with its two `trl` import lines pointing at lmppo.trl, nothing else changed."""
    changed = text.replace("\nfrom trl import ", "\nfrom lmppo.trl import ").replace(
        "\nfrom trl.experimental.ppo import ", "\nfrom lmppo.trl import "
    )
    assert changed.count("from lmppo.trl import ") == 2 and "from trl" not in changed
    return changed


def docstring_command(text: str) -> list[str]:
    """The flags of the first `python -i SCRIPT ...` command of the script's docstring."""
    block = re.search(r"python -i \S+ \\\n(.*?)\n\n", text, re.S)
    assert block is not None
    return shlex.split(block.group(1).replace("\\\n", " "))


def hub_names_as_folders(root: Path, tokenizer) -> None:
    """Local folders under the Hub names the command uses: `from_pretrained` and `load_dataset` read a folder of
    that relative path before asking the Hub (which is off: HF_HUB_OFFLINE=1)."""
    tok_dir, model_dir = root / TOKENIZER_ID, root / MODEL_ID
    tokenizer.save_pretrained(tok_dir)
    tiny_llama(tokenizer).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    data = root / DATASET / "data"
    data.mkdir(parents=True)
    words = ["the movie was", "this film is", "the story seemed", "my friend felt", "the ending was"]
    rows = [{"prompt": f"{words[i % 5]} {i}"} for i in range(164)]  # 100 held out by the script, 64 to train on
    lines = "".join(json.dumps(r) + "\n" for r in rows)
    (data / "descriptiveness-00000-of-00001.jsonl").write_text(lines)


def run_script(root: Path, script: Path, flags: list[str]) -> subprocess.CompletedProcess:
    env = {**src_env(), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(root / "hf_home")}
    return subprocess.run(
        [sys.executable, str(script), *flags], cwd=root, capture_output=True, text=True, timeout=900, env=env
    )


@pytest.mark.slow
def test_trls_example_script_runs_with_its_docstring_command(tmp_path, tokenizer):
    text = trl_script()
    flags = docstring_command(text)
    assert "--missing_eos_penalty" in flags and "--stop_token" not in flags
    script = tmp_path / "ppo.py"
    script.write_text(with_lmppo_imports(text))
    hub_names_as_folders(tmp_path, tokenizer)
    done = run_script(tmp_path, script, [*flags, *SHORT])
    assert done.returncode == 0, done.stderr[-4000:]
    out = tmp_path / flags[flags.index("--output_dir") + 1]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    updates = [r for r in rows if "iteration" in r]
    assert len(updates) == 2
    # TRL's rule without a stop token: -1.0 for each response with no eos token, averaged over the batch
    assert all(-1.0 <= r["reward/missing_eos_penalty"] <= 0.0 for r in updates)
    assert min(r["reward/missing_eos_penalty"] for r in updates) < 0.0  # 6 tokens of an untrained model: some lack eos
    assert (out / "model.safetensors").is_file()
    config = (out / "config.yaml").read_text()  # the policy the script passed, not lmppo's default `smollm2`
    assert f"\nmodel:\n  policy: {MODEL_ID}\n" in config and "smollm2" not in config
    assert f"# model.policy: the policy object passed to PPOTrainer(model=...), loaded from {MODEL_ID}" in config


@pytest.mark.slow
def test_resuming_the_example_script_says_the_script_removed_the_folder(tmp_path, tokenizer):
    """TRL's script removes output_dir at start: a resume of it says so, and what to change, in one line."""
    text = trl_script()
    flags = docstring_command(text)
    script = tmp_path / "ppo.py"
    script.write_text(with_lmppo_imports(text))
    hub_names_as_folders(tmp_path, tokenizer)
    out = flags[flags.index("--output_dir") + 1]
    first = run_script(tmp_path, script, [*flags, *SHORT, "--save_strategy", "steps", "--save_steps", "1"])
    assert first.returncode == 0, first.stderr[-4000:]
    again = run_script(tmp_path, script, [*flags, *SHORT, "--resume_from_checkpoint", out])
    assert again.returncode != 0
    last = again.stderr.strip().splitlines()[-1]
    assert "held a run when the script's arguments were parsed and was removed before PPOTrainer started" in last
    assert "guard that line with `if not training_args.resume_from_checkpoint:`" in last
