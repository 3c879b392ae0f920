"""lmppo.training.reward_model: a reward model learns a preference, is saved as the folder `reward.sources` takes,
resumes to the weights of a run never stopped, and keeps the run folder's rules."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import tiny_llama
from lmppo.core.bradley_terry import pearson_correlation
from lmppo.data.preference_pairs import PreferencePair, load_preference_pairs, pair_texts
from lmppo.errors import ConfigError
from lmppo.training.reward_model import RewardModelSettings, RewardModelTrainer, split_pairs, train_reward_model

SUBJECTS = ["the movie", "this film", "the story", "my friend", "the actor", "a critic", "the ending", "the music"]


def write_pairs(path, count=48):
    """A preference any model can learn: `great` over `awful`, in otherwise equal sentences."""
    rows = [
        {"chosen": f"{SUBJECTS[i % 8]} was great {i}", "rejected": f"{SUBJECTS[i % 8]} was awful {i}"}
        for i in range(count)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture()
def base(tmp_path, tokenizer):
    folder = tmp_path / "base"
    tiny_llama(tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def settings(tmp_path, base, **kw):
    fields = dict(data=write_pairs(tmp_path / "pairs.jsonl"), base=base, output_dir=str(tmp_path / "rm"))
    fields.update(dict(epochs=3, batch_size=8, held_out=16, learning_rate=3e-3, checkpoint_every=2, lora_r=4))
    return RewardModelSettings(**{**fields, **kw})


def test_it_learns_the_preference_and_saves_what_reward_sources_take(tmp_path, base):
    from lmppo.config import RewardSourceConfig
    from lmppo.rewards import ModelSource, SourceContext

    lines = []
    result = train_reward_model(settings(tmp_path, base), say=lines.append)
    assert result.after[0] == 1.0 and result.after[1] > result.before[1] + 0.5, (result.before, result.after)
    assert result.steps == 3 * 4  # 32 training pairs in batches of 8, 3 epochs
    assert any(line.startswith("before training: held-out pair accuracy") for line in lines)
    source = ModelSource(RewardSourceConfig(kind="model", path=result.model_dir), SourceContext())
    scores = source(["", ""], ["the movie was great 99", "the movie was awful 99"])
    assert scores[0] > scores[1]
    card = open(os.path.join(result.model_dir, "README.md")).read()
    assert "| after | 1.000 |" in card and f"path: {result.model_dir}" in card
    rows = [json.loads(x) for x in open(os.path.join(tmp_path, "rm", "metrics.jsonl"))]
    assert [r["step"] for r in rows] == list(range(13)) and "heldout/pair_accuracy" in rows[4]


def test_the_saved_model_scores_as_the_trainer_did(tmp_path, base):
    """The folder's scores through `reward.sources` (ModelSource) are the trainer's own for the same texts."""
    from lmppo.config import RewardSourceConfig
    from lmppo.rewards import ModelSource, SourceContext

    trainer = RewardModelTrainer(settings(tmp_path, base, epochs=1, precision="fp32"))
    result = trainer.train()
    texts = ["the story was great 7", "a critic was awful and the ending was great 3"]
    with torch.no_grad():
        ours = trainer.scores(texts)  # fp32 (as the source reads it): the same numbers, not only close
    source = ModelSource(RewardSourceConfig(kind="model", path=result.model_dir), SourceContext())
    assert torch.allclose(torch.tensor(source(["", ""], texts)), ours, atol=1e-4)


def test_the_length_bias_check_is_the_correlation_of_held_out_scores_with_token_counts(tmp_path, base):
    lines = []
    trainer = RewardModelTrainer(settings(tmp_path, base, epochs=1, precision="fp32"), say=lines.append)
    result = trainer.train()
    texts = [pair_texts(p, trainer.tokenizer) for p in trainer.heldout_pairs]
    texts = [c for c, _ in texts] + [r for _, r in texts]
    with torch.no_grad():
        scores = trainer.scores(texts)
    lengths = torch.tensor([len(trainer.tokenizer(t)["input_ids"]) for t in texts], dtype=torch.float64)
    assert lengths.std() > 0  # the held-out texts differ in length: the check has something to measure
    expected = pearson_correlation(scores, lengths)
    assert result.after[2] == pytest.approx(expected, abs=1e-4)  # scored in batches of 8 there, padded otherwise
    rows = [json.loads(x) for x in open(os.path.join(tmp_path, "rm", "metrics.jsonl"))]
    assert rows[-1]["heldout/length_correlation"] == pytest.approx(expected, abs=1e-4)
    assert rows[0]["heldout/length_correlation"] == pytest.approx(result.before[2])
    before, after = result.before, result.after
    assert any(f"score-length correlation {before[2]:+.3f} -> {after[2]:+.3f}" in line for line in lines)
    card = open(os.path.join(result.model_dir, "README.md")).read()
    assert f"| after | {after[0]:.3f} | {after[1]:+.3f} | {after[2]:+.3f} |" in card


def test_a_held_out_response_never_trains():
    """`builtin:polarity-continuations` uses each response in several pairs: a pair sharing one with a held-out pair
    is left out."""
    pairs = [PreferencePair(chosen=f"good {i % 4}", rejected=f"bad {i % 5}") for i in range(20)]
    train, heldout = split_pairs(pairs, 2, seed=0)
    unseen = {side for p in heldout for side in (p.chosen, p.rejected)}
    assert len(heldout) == 2 and train and len(train) < 18
    assert not any(p.chosen in unseen or p.rejected in unseen for p in train)
    kept = [p for p in pairs if p not in heldout and p.chosen not in unseen and p.rejected not in unseen]
    assert sorted(train, key=str) == sorted(kept, key=str)  # every pair that shares nothing still trains
    shared = [PreferencePair(chosen=f"good {i}", rejected="bad") for i in range(5)]
    with pytest.raises(ConfigError, match="leaves no pair to train on"):
        split_pairs(shared, 1, seed=0)


def test_a_held_out_origin_never_trains():
    """A pair made from a text (`origin`) that a held-out pair holds as a response or was made from is left out:
    `builtin:polarity-mixed` holds each corpus line whole and cut to a continuation."""
    line = "the film was great and the cast shone."
    pairs = [
        PreferencePair(chosen=line, rejected="the film was dull."),
        PreferencePair(chosen=" was great and", rejected=" was dull and", prompt="The film", origin=(line, "x")),
        PreferencePair(chosen=" the cast shone.", rejected=" the cast slept.", prompt="And", origin=("y", "z")),
    ]
    for held in (pairs[0], pairs[1]):  # pairs 0 and 1 share no response, only a text
        seed = next(s for s in range(100) if split_pairs(pairs, 1, s)[1] == [held])
        assert split_pairs(pairs, 1, seed)[0] == [pairs[2]]
    train, heldout = split_pairs(load_preference_pairs("builtin:polarity-mixed"), 30, 0)
    held_texts = {t for p in heldout for t in (p.chosen, p.rejected, *p.origin)}
    assert train and not any(held_texts & {p.chosen, p.rejected, *p.origin} for p in train)


def test_the_command_with_no_data_trains_on_the_mixed_set():
    assert RewardModelSettings().data == "builtin:polarity-mixed"


def test_precision_bf16_autocasts_the_scores_and_fp32_does_not(tmp_path, base):
    texts = ["the story was great 7", "a critic was awful and the ending was great 3"]
    scores = {}
    for precision in ("fp32", "bf16"):
        trainer = RewardModelTrainer(
            settings(tmp_path, base, precision=precision, output_dir=str(tmp_path / precision))
        )
        assert trainer.precision.precision == precision
        with torch.no_grad():
            scores[precision] = trainer.scores(texts)
        inner = trainer.model.get_base_model()
        enc = trainer.tokenizer(texts, return_tensors="pt", padding=True)
        with torch.no_grad():
            hidden = inner.base_model(**enc)[0]
        assert hidden.dtype == torch.float32  # outside the trainer's scores nothing is cast
    assert not torch.equal(scores["fp32"], scores["bf16"])  # bf16 rounding: the option took effect
    assert torch.allclose(scores["fp32"], scores["bf16"], atol=0.1)
    with pytest.raises(ConfigError, match="`precision` = 'fp16': must be one of auto, fp32, bf16"):
        RewardModelTrainer(settings(tmp_path, base, precision="fp16"))


def test_lora_or_every_weight(tmp_path, base):
    lora = RewardModelTrainer(settings(tmp_path, base))
    full = RewardModelTrainer(settings(tmp_path, base, lora=False, output_dir=str(tmp_path / "full")))
    lora_names = [n for n, p in lora.model.named_parameters() if p.requires_grad]
    full_names = [n for n, p in full.model.named_parameters() if p.requires_grad]
    assert all("lora_" in n or "score" in n for n in lora_names) and any("lora_" in n for n in lora_names)
    assert len(full_names) == len(list(full.model.parameters())) and not any("lora_" in n for n in full_names)


def test_the_run_folder_rules(tmp_path, base):
    out = tmp_path / "rm"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"holds files that are not a reward-model run's \(notes.txt\)"):
        RewardModelTrainer(settings(tmp_path, base, overwrite=True))
    (out / "notes.txt").unlink()
    train_reward_model(settings(tmp_path, base, epochs=1), say=lambda _: None)
    with pytest.raises(ConfigError, match="holds a reward-model run; .*`--resume` it, or `--overwrite`"):
        RewardModelTrainer(settings(tmp_path, base))
    with pytest.raises(ConfigError, match="`held_out` = 48: must leave pairs to train on"):
        RewardModelTrainer(settings(tmp_path, base, held_out=48, overwrite=True))
    train_reward_model(settings(tmp_path, base, epochs=1, overwrite=True), say=lambda _: None)


WORKER = """
import sys
from lmppo.training.reward_model import RewardModelSettings, train_reward_model
s = RewardModelSettings(data=sys.argv[1], base=sys.argv[2], output_dir=sys.argv[3], epochs=3, batch_size=8,
                        held_out=16, learning_rate=3e-3, checkpoint_every=2, lora_r=4)
train_reward_model(s, resume=sys.argv[4] == "resume", say=lambda line: None)
"""


def test_a_killed_run_resumes_to_the_weights_of_a_run_never_stopped(tmp_path, base):
    """A real SIGKILL once checkpoint iter-4 exists; `resume` then ends with the uninterrupted run's weights."""
    from safetensors.torch import load_file

    data = write_pairs(tmp_path / "pairs.jsonl")

    def command(out, mode):
        return [sys.executable, "-c", WORKER, data, base, str(out), mode]

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out, straight = tmp_path / "killed", tmp_path / "straight"
    proc = subprocess.Popen(command(out, "new"), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not (out / "checkpoints" / "iter-00000004").is_dir() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it was killed"
    assert not (out / "model").exists()
    subprocess.run(command(out, "resume"), env=env, check=True, capture_output=True, timeout=300)
    subprocess.run(command(straight, "new"), env=env, check=True, capture_output=True, timeout=300)
    resumed, never = load_file(out / "model" / "model.safetensors"), load_file(straight / "model" / "model.safetensors")
    assert set(resumed) == set(never) and all(torch.equal(resumed[k], never[k]) for k in never)
    rows = [json.loads(x) for x in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == list(range(13))  # the rows after the checkpoint were cut, then written again
