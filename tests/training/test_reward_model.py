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
from lmppo.config import RewardModelConfig, load_root
from lmppo.core.bradley_terry import bradley_terry_loss, pearson_correlation
from lmppo.data.preference_pairs import PreferencePair, load_preference_pairs, pair_texts
from lmppo.errors import ConfigError
from lmppo.training.reward_model import RewardModelTrainer, split_pairs, train_reward_model

SUBJECTS = ["the movie", "this film", "the story", "my friend", "the actor", "a critic", "the ending", "the music"]


def write_pairs(path, count=48, margin=None):
    """A preference any model can learn: `great` over `awful`, in otherwise equal sentences."""
    rows = [
        {"chosen": f"{SUBJECTS[i % 8]} was great {i}", "rejected": f"{SUBJECTS[i % 8]} was awful {i}"}
        for i in range(count)
    ]
    if margin is not None:
        rows = [{**r, "margin": margin(i)} for i, r in enumerate(rows)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture()
def base(tmp_path, tokenizer):
    folder = tmp_path / "base"
    tiny_llama(tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def config(tmp_path, base, overrides=None):
    """A small run's config, as dotted overrides (`lmppo reward-model --section.field VALUE`) set it."""
    fields = {
        "data.pairs": write_pairs(tmp_path / "pairs.jsonl"),
        "model.policy": base,
        "output_dir": str(tmp_path / "rm"),
        "training.epochs": 3,
        "training.batch_size": 8,
        "data.holdout": 16,
        "training.learning_rate": 3e-3,
        "checkpoint.every": 2,
        "model.lora.r": 4,
        "log.trackers": "[]",
    }
    return load_root(RewardModelConfig, None, {**fields, **(overrides or {})})


def test_it_learns_the_preference_and_saves_what_reward_sources_take(tmp_path, base):
    from lmppo.config import RewardSourceConfig
    from lmppo.rewards import ModelSource, SourceContext

    lines = []
    result = train_reward_model(config(tmp_path, base), say=lines.append)
    assert result.after[0] == 1.0 and result.after[1] > result.before[1] + 0.5, (result.before, result.after)
    assert result.steps == 3 * 4  # 32 training pairs in batches of 8, 3 epochs
    assert any(line.startswith("before training: held-out pair accuracy") for line in lines)
    source = ModelSource(RewardSourceConfig(kind="model", path=result.model_dir), SourceContext())
    scores = source(["", ""], ["the movie was great 99", "the movie was awful 99"])
    assert scores[0] > scores[1]
    card = open(os.path.join(result.model_dir, "README.md")).read()
    assert "| after | 1.000 |" in card and f"path: {result.model_dir}" in card
    rows = [json.loads(x) for x in open(os.path.join(tmp_path, "rm", "metrics.jsonl"))]
    assert [r["iteration"] for r in rows] == list(range(13)) and "heldout/pair_accuracy" in rows[4]
    assert result.model_dir == os.path.join(tmp_path, "rm", "final", "reward-model")


def test_the_saved_model_scores_as_the_trainer_did(tmp_path, base):
    """The folder's scores through `reward.sources` (ModelSource) are the trainer's own for the same texts."""
    from lmppo.config import RewardSourceConfig
    from lmppo.rewards import ModelSource, SourceContext

    trainer = RewardModelTrainer(config(tmp_path, base, {"training.epochs": 1, "precision": "fp32"}))
    result = trainer.train()
    texts = ["the story was great 7", "a critic was awful and the ending was great 3"]
    with torch.no_grad():
        ours = trainer.scores(texts)  # fp32 (as the source reads it): the same numbers, not only close
    source = ModelSource(RewardSourceConfig(kind="model", path=result.model_dir), SourceContext())
    assert torch.allclose(torch.tensor(source(["", ""], texts)), ours, atol=1e-4)


def test_the_length_bias_check_is_the_correlation_of_held_out_scores_with_token_counts(tmp_path, base):
    lines = []
    trainer = RewardModelTrainer(config(tmp_path, base, {"training.epochs": 1, "precision": "fp32"}), say=lines.append)
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
    assert RewardModelConfig().data.pairs == "builtin:polarity-mixed"


def test_precision_bf16_autocasts_the_scores_and_fp32_does_not(tmp_path, base):
    texts = ["the story was great 7", "a critic was awful and the ending was great 3"]
    scores = {}
    for precision in ("fp32", "bf16"):
        trainer = RewardModelTrainer(
            config(tmp_path, base, {"precision": precision, "output_dir": str(tmp_path / precision)})
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
    with pytest.raises(ConfigError, match="`precision` = 'fp16': must be one of `auto`, `fp32`, `bf16`"):
        config(tmp_path, base, {"precision": "fp16"})


def test_lora_or_every_weight(tmp_path, base):
    lora = RewardModelTrainer(config(tmp_path, base, {"model.lora.alpha": 12}))
    full = RewardModelTrainer(
        config(tmp_path, base, {"model.lora.enabled": False, "output_dir": str(tmp_path / "full")})
    )
    settings = lora.model.peft_config["default"]
    assert (settings.r, settings.lora_alpha) == (4, 12)  # model.lora.r and model.lora.alpha reached peft
    lora_names = [n for n, p in lora.model.named_parameters() if p.requires_grad]
    full_names = [n for n, p in full.model.named_parameters() if p.requires_grad]
    assert all("lora_" in n or "score" in n for n in lora_names) and any("lora_" in n for n in lora_names)
    assert len(full_names) == len(list(full.model.parameters())) and not any("lora_" in n for n in full_names)


def test_the_run_folder_rules(tmp_path, base):
    """The rules of `lmppo train`'s run folder (`lmppo.run.folder`): files lmppo did not write are never used nor
    removed, a finished run is kept unless `overwrite`, and only its own files go then."""
    out = tmp_path / "rm"
    out.mkdir()
    (out / "metrics.jsonl").write_text("mine")
    with pytest.raises(ConfigError, match=r"holds files lmppo did not write \(metrics.jsonl\)"):
        RewardModelTrainer(config(tmp_path, base, {"overwrite": True}))
    (out / "metrics.jsonl").unlink()
    (out / "notes.txt").write_text("mine")
    train_reward_model(config(tmp_path, base, {"training.epochs": 1}), say=lambda _: None)
    with pytest.raises(ConfigError, match=r"already holds a run .*`lmppo reward-model --resume .*overwrite: true"):
        RewardModelTrainer(config(tmp_path, base))
    with pytest.raises(ConfigError, match="`data.holdout` = 48: must leave pairs to train on"):
        RewardModelTrainer(config(tmp_path, base, {"data.holdout": 48, "overwrite": True}))
    train_reward_model(config(tmp_path, base, {"training.epochs": 1, "overwrite": True}), say=lambda _: None)
    assert (out / "notes.txt").read_text() == "mine" and (out / "final" / "reward-model" / "README.md").is_file()
    assert (out / "config.yaml").read_text().startswith("# lmppo run config (secrets masked); resume with: lmppo ")
    assert "lmppo reward-model --resume OUTPUT_DIR" in (out / "config.yaml").read_text().splitlines()[0]


WORKER = """
import sys
from lmppo import RewardModelConfig, RewardModelTrainer
if sys.argv[4] == "resume":
    RewardModelTrainer.resume(sys.argv[3], say=lambda line: None).train()
else:
    cfg = RewardModelConfig(output_dir=sys.argv[3], seed=0)
    cfg.data.pairs, cfg.model.policy, cfg.data.holdout, cfg.log.trackers = sys.argv[1], sys.argv[2], 16, []
    cfg.training.epochs, cfg.training.batch_size, cfg.training.learning_rate = 3, 8, 3e-3
    cfg.checkpoint.every, cfg.model.lora.r = 2, 4
    RewardModelTrainer(cfg, say=lambda line: None).train()
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
    assert not (out / "final").exists()
    subprocess.run(command(out, "resume"), env=env, check=True, capture_output=True, timeout=300)
    subprocess.run(command(straight, "new"), env=env, check=True, capture_output=True, timeout=300)
    model = os.path.join("final", "reward-model", "model.safetensors")
    resumed, never = load_file(out / model), load_file(straight / model)
    assert set(resumed) == set(never) and all(torch.equal(resumed[k], never[k]) for k in never)
    rows = [json.loads(x) for x in open(out / "metrics.jsonl")]
    assert [r["iteration"] for r in rows] == list(range(13))  # the rows after the checkpoint cut, then written again
    state = json.loads((out / "checkpoints" / "iter-00000012" / "state.json").read_text())
    assert state["format"] and state["iteration"] == 12 and state["config"]["training"]["epochs"] == 3  # PPO's format


def test_the_data_margin_enters_the_loss_as_trl_puts_it(tmp_path, base):
    """TRL's `margin` column: -log sigmoid(r_chosen - r_rejected - margin); the same pairs without it give another
    loss."""
    data = write_pairs(tmp_path / "margins.jsonl", margin=lambda i: 0.5 * (i % 3))
    trainer = RewardModelTrainer(config(tmp_path, base, {"data.pairs": data, "training.epochs": 1}))
    batch = trainer.train_pairs[:8]
    assert {p.margin for p in batch} <= {0.0, 0.5, 1.0} and any(p.margin for p in batch)
    with torch.no_grad():
        loss, logged = trainer.batch_loss(batch)
        chosen, rejected = trainer.pair_scores(batch)
    diff = chosen - rejected - torch.tensor([p.margin for p in batch])
    by_hand = float(torch.log1p(torch.exp(-diff)).mean())
    assert float(loss) == pytest.approx(by_hand, rel=1e-5) and logged == pytest.approx(by_hand, rel=1e-5)
    assert abs(float(loss) - float(bradley_terry_loss(chosen, rejected))) > 1e-3  # the margin changed it


def test_center_rewards_coefficient_adds_the_mean_squared_sum(tmp_path, base):
    """TRL's `center_rewards_coefficient`: the loss plus coef x mean((r_chosen + r_rejected)^2)."""
    trainer = RewardModelTrainer(config(tmp_path, base, {"training.center_rewards_coefficient": 0.5}))
    batch = trainer.train_pairs[:8]
    with torch.no_grad():
        loss, _ = trainer.batch_loss(batch)
        chosen, rejected = trainer.pair_scores(batch)
    plain = float(torch.log1p(torch.exp(-(chosen - rejected))).mean())
    centring = 0.5 * float(((chosen + rejected) ** 2).mean())
    assert centring > 1e-3 and float(loss) == pytest.approx(plain + centring, rel=1e-5)


def test_log_trackers_receive_the_metrics(tmp_path, base):
    """`log.trackers: [tensorboard]` (the default, as `lmppo train`): the held-out figures and the loss in
    OUTPUT_DIR/tensorboard; `[]`: no tracker, metrics.jsonl alone."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = config(tmp_path, base, {"training.epochs": 1, "log.trackers": "[tensorboard]"})
    assert RewardModelConfig().log.trackers == ["tensorboard"]
    train_reward_model(cfg, say=lambda _: None)
    events = EventAccumulator(str(tmp_path / "rm" / "tensorboard"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert {"loss", "heldout/pair_accuracy", "heldout/margin"} <= set(tags)
    assert [e.step for e in events.Scalars("heldout/pair_accuracy")] == [0, 4]
    train_reward_model(config(tmp_path, base, {"training.epochs": 1, "output_dir": str(tmp_path / "none")}))
    assert not (tmp_path / "none" / "tensorboard").exists() and (tmp_path / "none" / "metrics.jsonl").is_file()


def test_the_device_is_chosen_as_for_ppo_and_the_precision_for_that_device(tmp_path, base):
    """`device: auto` is accelerate's choice (CUDA where present), `cpu` forces the CPU, and `precision: auto` is
    resolved for the device the run got (recorded in config.yaml, as `lmppo train` does)."""
    from lmppo.models.precision import choose_precision

    auto = RewardModelTrainer(config(tmp_path, base))
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert auto.accelerator.device.type == expected and next(auto.model.parameters()).device.type == expected
    assert auto.precision == choose_precision("auto", expected) and auto.config.precision == auto.precision.precision
    cpu = RewardModelTrainer(config(tmp_path, base, {"device": "cpu", "output_dir": str(tmp_path / "cpu")}))
    assert cpu.accelerator.device.type == "cpu" and next(cpu.model.parameters()).device.type == "cpu"
    assert f"precision: {cpu.config.precision}" in (tmp_path / "cpu" / "config.yaml").read_text()
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="`device` = 'cuda': no CUDA GPU is visible"):
            RewardModelTrainer(config(tmp_path, base, {"device": "cuda", "output_dir": str(tmp_path / "gpu")}))
        assert not (tmp_path / "gpu").exists()  # refused before the run folder or any model


def test_pairs_through_the_api(tmp_path, base):
    """`RewardModelTrainer(cfg, pairs=rows)`: rows in TRL's format instead of `data.pairs`."""
    rows = [{"chosen": f"good {i}", "rejected": f"bad {i}", "margin": 1.0} for i in range(24)]
    trainer = RewardModelTrainer(config(tmp_path, base, {"data.holdout": 4}), pairs=rows)
    assert len(trainer.train_pairs) == 20 and all(p.margin == 1.0 for p in trainer.train_pairs)
