"""lmppo.trl.trainer: TRL's PPOTrainer constructor on tiny models, the objects used as given, TRL's log history and
callbacks, and TRL's example script run unchanged but for its import line."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from conftest import PROMPTS, tiny_llama
from lmppo.errors import ConfigError
from lmppo.trl import PPOTrainer
from trl_support import EXAMPLE, TRL_LOG_HISTORY_KEYS, input_ids_dataset, seq_cls, src_env, trainer_args

datasets = pytest.importorskip("datasets")


def test_drop_in_trains_with_the_objects_as_given(tmp_path, tokenizer):
    from transformers import AutoModelForCausalLM, TrainerCallback

    class Record(TrainerCallback):
        def __init__(self):
            self.events = []

        def on_train_begin(self, args, state, control, **kw):
            self.events.append("train_begin")

        def on_log(self, args, state, control, logs=None, **kw):
            self.events.append(("log", dict(logs)))

        def on_step_end(self, args, state, control, **kw):
            self.events.append("step_end")

        def on_train_end(self, args, state, control, **kw):
            self.events.append("train_end")

    policy, ref = tiny_llama(tokenizer), tiny_llama(tokenizer)
    reward, value = seq_cls(tokenizer, 1), seq_cls(tokenizer, 2)
    value_before = {k: v.clone() for k, v in value.state_dict().items()}
    ref_before = {k: v.clone() for k, v in ref.state_dict().items()}
    record = Record()
    tok = tokenizer
    tok.padding_side = "left"
    trainer = PPOTrainer(
        args=trainer_args(tmp_path),
        processing_class=tok,
        model=policy,
        ref_model=ref,
        reward_model=reward,
        train_dataset=input_ids_dataset(tok, PROMPTS),
        value_model=value,
        eval_dataset=input_ids_dataset(tok, PROMPTS[:5]),
        callbacks=[record],
    )
    engine = trainer.lmppo
    assert engine.accelerator.unwrap_model(engine.critic).model is value  # the value model is the critic
    assert engine.reference.model is ref  # the reference is the object passed in
    assert trainer.reward_source.model is reward and trainer.reward_source.wants_token_ids
    assert (trainer.args.batch_size, trainer.args.num_total_batches, trainer.args.world_size) == (4, 2, 1)
    trainer.train()
    history = trainer.state.log_history
    assert len(history) == 2 and all(set(h) == TRL_LOG_HISTORY_KEYS for h in history)
    assert [h["step"] for h in history] == [1, 2] and [h["episode"] for h in history] == [4, 8]
    assert history[-1]["epoch"] == 1.0
    assert record.events[0] == "train_begin" and record.events[-1] == "train_end"
    assert [e for e in record.events if e == "step_end"] == ["step_end"] * 2
    logged = [e[1] for e in record.events if isinstance(e, tuple)]
    assert [set(l) for l in logged] == [TRL_LOG_HISTORY_KEYS - {"step"}] * 2
    for h, m in zip(history, trainer.lmppo_history):  # TRL's names carry lmppo's values
        assert h["objective/kl"] == m["objective/kl"] and h["loss/value_avg"] == m["loss/value_avg"]
    assert any(not torch.equal(value_before[k], v) for k, v in value.state_dict().items())  # the critic trained
    assert all(torch.equal(ref_before[k], v) for k, v in ref.state_dict().items())  # the reference did not
    out = tmp_path / "saved"
    trainer.save_model(str(out))
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(reloaded.lm_head.weight, trainer.model.policy.lm_head.weight)
    assert json.loads((out / "training_args.json").read_text())["num_ppo_epochs"] == 2
    rows = trainer.generate_completions()
    assert len(rows) == 4  # 5 eval prompts in batches of 2, the last partial batch dropped (as TRL)
    assert set(rows[0]) == {"query", "model response", "score"} and all(math.isfinite(r["score"]) for r in rows)
    assert len(trainer.generate_completions(sampling=True)) == 2
    # near-greedy, as TRL: the run's road at this call's temperature 0.01, not the run's (the seeds as TRL's)
    from lmppo.sampling.hf import left_pad
    from lmppo.sampling.native import response_seed, sample_native
    from lmppo.trl.inputs import prompt_ids

    engine = trainer.lmppo
    first = [list(r) for r in prompt_ids(trainer.eval_dataset)][:2]
    ids, mask = left_pad(first, engine.tokenizer.pad_token_id)
    seeds = [response_seed(engine.config.seed + 1, engine.iteration, i) for i in range(2)]
    args = (engine.config.rollout.max_new_tokens, engine.stop_ids, engine.tokenizer.pad_token_id, seeds)
    for temperature, same in ((0.01 + 1e-7, True), (engine.config.rollout.temperature, False)):
        resp, resp_mask, _, _ = sample_native(engine.policy, ids, mask, temperature, *args)
        texts = [engine.tokenizer.decode(r[m].tolist()) for r, m in zip(resp, resp_mask)]
        assert ([row["model response"] for row in rows[:2]] == texts) is same, temperature


def test_peft_config_without_ref_model_uses_the_adapter_off_reference(tmp_path, tokenizer):
    from peft import LoraConfig

    tokenizer.padding_side = "left"
    trainer = PPOTrainer(
        args=trainer_args(tmp_path, total_episodes=4),
        processing_class=tokenizer,
        model=tiny_llama(tokenizer),
        ref_model=None,
        reward_model=seq_cls(tokenizer, 1),
        train_dataset=input_ids_dataset(tokenizer, PROMPTS),
        value_model=seq_cls(tokenizer, 2),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    assert trainer.is_peft_model and trainer.lmppo.reference.adapter_off and trainer.lmppo.reference.model is None
    assert trainer.config.model.lora.enabled and trainer.config.model.lora.r == 4
    trainer.train()
    assert len(trainer.state.log_history) == 1


def test_trainer_arguments_lmppo_cannot_honour(tmp_path, tokenizer):
    from transformers import DataCollatorWithPadding

    tokenizer.padding_side = "left"
    policy = tiny_llama(tokenizer)
    common = dict(
        args=trainer_args(tmp_path),
        processing_class=tokenizer,
        model=policy,
        reward_model=seq_cls(tokenizer, 1),
        train_dataset=input_ids_dataset(tokenizer, PROMPTS),
        value_model=seq_cls(tokenizer, 2),
    )
    with pytest.raises(ConfigError, match="`ref_model`"):
        PPOTrainer(ref_model=policy, **common)
    with pytest.raises(ConfigError, match="`data_collator`"):
        PPOTrainer(ref_model=None, data_collator=DataCollatorWithPadding(tokenizer), **common)
    opt = torch.optim.SGD(policy.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="`optimizers`"):
        PPOTrainer(ref_model=None, optimizers=(opt, None), **common)
    with pytest.raises(ConfigError, match="`whiten_rewards`"):
        PPOTrainer(ref_model=None, **{**common, "args": trainer_args(tmp_path, whiten_rewards=True)})


def test_peft_config_with_a_ref_model_uses_that_model(tmp_path, tokenizer):
    from peft import LoraConfig

    tokenizer.padding_side = "left"
    ref = tiny_llama(tokenizer, seed=3)
    trainer = PPOTrainer(
        args=trainer_args(tmp_path, total_episodes=4),
        processing_class=tokenizer,
        model=tiny_llama(tokenizer),
        ref_model=ref,
        reward_model=seq_cls(tokenizer, 1),
        train_dataset=input_ids_dataset(tokenizer, PROMPTS),
        value_model=seq_cls(tokenizer, 2),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    reference = trainer.lmppo.reference
    assert reference.model is ref and not reference.adapter_off
    ids = torch.tensor([tokenizer("the movie was good")["input_ids"]])
    mask = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():  # the reference log-probs are the given model's, not the adapter-off policy's
        expected = torch.log_softmax(ref(ids).logits[:, 1:-1], -1).gather(-1, ids[:, 2:, None]).squeeze(-1)
        got = reference.logprobs(trainer.lmppo.policy, ids, mask, 2, ids[:, 2:], 1.0)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    trainer.train()
    assert len(trainer.state.log_history) == 1


def test_a_pad_token_added_beyond_the_models_vocabulary(tmp_path, tokenizer):
    """TRL's example script adds a `[PAD]` token the models have no embedding for; lmppo pads with eos instead."""
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.add_special_tokens({"pad_token": "[NEWPAD]"})
    tok.padding_side = "left"
    assert tok.pad_token_id >= len(tokenizer)  # outside the tiny models' embeddings (built on `tokenizer`)
    trainer = PPOTrainer(
        args=trainer_args(tmp_path, total_episodes=4),
        processing_class=tok,
        model=tiny_llama(tokenizer),
        ref_model=None,
        reward_model=seq_cls(tokenizer, 1),
        train_dataset=input_ids_dataset(tok, PROMPTS),
        value_model=seq_cls(tokenizer, 2),
        eval_dataset=input_ids_dataset(tok, PROMPTS[:2]),
    )
    assert trainer.lmppo.tokenizer.pad_token_id == tokenizer.eos_token_id and tok.pad_token == "[NEWPAD]"
    trainer.train()
    assert len(trainer.state.log_history) == 1 and len(trainer.generate_completions()) == 2


@pytest.mark.slow
def test_the_trl_style_example_script_runs_with_the_drop_in(tmp_path):
    """examples/trl_ppo_script.py (only its import line differs from its TRL 1.12 form) finishes under lmppo and its
    log_history has TRL's metric names."""
    out = tmp_path / "run"
    done = subprocess.run(
        [
            sys.executable,
            str(EXAMPLE),
            "--output_dir",
            str(out),
            "--use_cpu",
            "--bf16",
            "false",
            "--report_to",
            "none",
            "--per_device_train_batch_size",
            "4",
            "--total_episodes",
            "8",
            "--response_length",
            "4",
            "--num_ppo_epochs",
            "1",
            "--stop_token",
            "eos",
            "--missing_eos_penalty",
            "1.0",
            "--local_rollout_forward_batch_size",
            "4",
            "--per_device_eval_batch_size",
            "2",
            "--num_sample_generations",
            "1",
            "--save_strategy",
            "no",
            "--disable_tqdm",
            "true",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=src_env(),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    history = json.loads((out / "log_history.json").read_text())
    assert len(history) == 2 and all(set(h) == TRL_LOG_HISTORY_KEYS for h in history)
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()


def test_one_warning_names_the_fields_set_without_effect_and_checkpointing_is_applied(tmp_path, tokenizer):
    import warnings

    from lmppo.models.loading import hf_model

    tokenizer.padding_side = "left"
    common = dict(
        processing_class=tokenizer,
        ref_model=None,
        reward_model=seq_cls(tokenizer, 1),
        train_dataset=input_ids_dataset(tokenizer, PROMPTS),
        value_model=seq_cls(tokenizer, 2),
    )
    ignored = trainer_args(tmp_path, max_steps=3, eval_strategy="steps", eval_steps=2, hub_model_id="me/model")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = PPOTrainer(args=ignored, model=tiny_llama(tokenizer), **common)
    ours = [str(w.message) for w in caught if str(w.message).startswith("lmppo.trl:")]
    assert len(ours) == 1 and [w.category for w in caught if str(w.message) == ours[0]] == [UserWarning]
    lines = ours[0].splitlines()[1:]
    assert [line.split(":")[0].strip() for line in lines] == ["run length", "evaluation", "the Hub"]
    assert "max_steps=3" in lines[0] and "eval_strategy='steps', eval_steps=2" in lines[1]
    assert not any("FutureWarning" in w.category.__name__ for w in caught)  # none from TrainingArguments either
    assert hf_model(trainer.lmppo.policy).is_activation_checkpointing  # gradient_checkpointing=True, TRL's default
    del trainer
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain = trainer_args(tmp_path, gradient_checkpointing=False)
        trainer = PPOTrainer(args=plain, model=tiny_llama(tokenizer), **common)
    assert not [w for w in caught if str(w.message).startswith("lmppo.trl:")]  # nothing set without effect
    assert not hf_model(trainer.lmppo.policy).is_activation_checkpointing


def test_a_killed_run_resumes_as_its_config_header_says(tmp_path):
    """A real SIGKILL after the second checkpoint; then what config.yaml's first line says (the same script with
    --resume_from_checkpoint OUTPUT_DIR) finishes the run, its log history whole, its weights those of a run never
    stopped."""
    import os
    import signal
    import time

    from safetensors.torch import load_file

    def command(out, *extra):
        return [sys.executable, str(EXAMPLE), "--output_dir", str(out), *EXAMPLE_ARGS, *extra]

    out, straight = tmp_path / "run", tmp_path / "straight"
    proc = subprocess.Popen(command(out), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=src_env())
    deadline = time.time() + 600
    while not (out / "checkpoints" / "iter-00000002").is_dir() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it was killed: give it more updates"
    assert not (out / "log_history.json").exists()
    header = (out / "config.yaml").read_text().splitlines()[0]
    assert "resume with: the same script with --resume_from_checkpoint OUTPUT_DIR" in header
    done = subprocess.run(
        command(out, "--resume_from_checkpoint", str(out)), capture_output=True, text=True, timeout=600, env=src_env()
    )
    assert done.returncode == 0, done.stderr[-3000:]
    history = json.loads((out / "log_history.json").read_text())
    assert [h["step"] for h in history] == list(range(1, 7)) and history[-1]["episode"] == 24
    subprocess.run(command(straight), check=True, capture_output=True, timeout=600, env=src_env())
    expected = json.loads((straight / "log_history.json").read_text())
    assert [h["objective/kl"] for h in history] == [h["objective/kl"] for h in expected]
    resumed, never_stopped = load_file(out / "model.safetensors"), load_file(straight / "model.safetensors")
    assert all(torch.equal(resumed[k], never_stopped[k]) for k in never_stopped)


EXAMPLE_ARGS = (
    "--use_cpu",
    "--bf16",
    "false",
    "--report_to",
    "none",
    "--per_device_train_batch_size",
    "4",
    "--total_episodes",
    "24",
    "--response_length",
    "4",
    "--num_ppo_epochs",
    "1",
    "--stop_token",
    "eos",
    "--local_rollout_forward_batch_size",
    "4",
    "--per_device_eval_batch_size",
    "2",
    "--num_sample_generations",
    "0",
    "--save_strategy",
    "steps",
    "--save_steps",
    "1",
    "--disable_tqdm",
    "true",
)
"""The example script's arguments for a tiny run of 6 updates with a checkpoint after each."""
