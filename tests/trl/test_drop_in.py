"""The TRL 1.12 drop-in (lmppo.trl.drop_in): PPOConfig's fields against TRL's, the fields lmppo refuses, the translation
to lmppo's config, and PPOTrainer with TRL's constructor on tiny models."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import TESTS  # noqa: E402

datasets = pytest.importorskip("datasets")

from conftest import PROMPTS, tiny_llama  # noqa: E402
from lmppo.errors import ConfigError  # noqa: E402
from lmppo.trl.drop_in import (
    MAPPED,
    NO_EFFECT_IN_TRL,
    REFUSED_UNLESS_DEFAULT,
    TRL_LOG_KEYS,
    PPOConfig,  # noqa: E402
    PPOTrainer,
    check_fields,
    lmppo_config,
)
from trl_fields import dump  # noqa: E402

HERE = Path(TESTS)
STORED = HERE / "data" / "trl_1_12_ppo_config_fields.json"
# TRL 1.12's PPOTrainer.train(): the keys of its `metrics` dict, then Trainer.log adds `epoch` and `step`
TRL_LOG_HISTORY_KEYS = {
    "eps",
    "objective/kl",
    "objective/entropy",
    "objective/non_score_reward",
    "objective/rlhf_reward",
    "objective/scores",
    "policy/approxkl_avg",
    "policy/clipfrac_avg",
    "loss/policy_avg",
    "loss/value_avg",
    "val/clipfrac_avg",
    "policy/entropy_avg",
    "val/ratio",
    "val/ratio_var",
    "val/num_eos_tokens",
    "lr",
    "episode",
    "epoch",
    "step",
}


def trl_python() -> str | None:
    """The bench venv's interpreter (TRL 1.12), when there is one."""
    candidates = [os.environ.get("LMPPO_TRL_PYTHON", ""), str(HERE.parent / ".venv-trl" / "bin" / "python")]
    return next((c for c in candidates if c and os.path.isfile(c)), None)


def trl_fields() -> dict:
    """TRL 1.12's PPOConfig fields: read from TRL itself in the bench venv when present, else the stored list."""
    python = trl_python()
    stored = json.loads(STORED.read_text())
    if python is None:
        return stored
    out = subprocess.run(
        [python, str(HERE / "trl_fields.py")],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    live = json.loads(out.stdout)
    assert live["trl"] == "1.12.0"
    if live["transformers"] == stored["transformers"]:
        assert live["fields"] == stored["fields"], "the stored list differs from TRL 1.12's own: regenerate it"
    return live


def test_ppo_config_fields_names_types_defaults_match_trl_1_12():
    import transformers

    trl = trl_fields()
    ours = dump(PPOConfig)
    if trl["transformers"] == transformers.__version__:
        # the whole list, in order: TrainingArguments' fields (same transformers) plus TRL's overrides and PPO fields
        assert ours == trl["fields"]
    else:  # another transformers version changes TrainingArguments itself: compare the fields TRL declares
        declared = set(PPOConfig.__annotations__)
        assert [r for r in ours if r["name"] in declared] == [r for r in trl["fields"] if r["name"] in declared]
    by_name = {r["name"]: r for r in ours}
    for name, default in (
        ("learning_rate", "3e-06"),
        ("response_length", "53"),
        ("temperature", "0.7"),
        ("kl_coef", "0.05"),
        ("num_ppo_epochs", "4"),
        ("local_rollout_forward_batch_size", "64"),
        ("logging_steps", "10"),
        ("gradient_checkpointing", "True"),
        ("bf16", "None"),
    ):
        assert by_name[name]["default"] == default


def test_the_logged_names_are_trls():
    assert set(TRL_LOG_KEYS) | {"epoch", "step"} == TRL_LOG_HISTORY_KEYS


def test_every_field_is_translated_inert_or_refused():
    names = {f.name for f in dataclasses.fields(PPOConfig)}
    assert set(MAPPED) | set(NO_EFFECT_IN_TRL) == names
    assert not set(MAPPED) & set(NO_EFFECT_IN_TRL)
    assert set(REFUSED_UNLESS_DEFAULT) <= set(MAPPED)


def test_hf_argument_parser_parses_trl_flags_and_prints_help():
    from transformers import HfArgumentParser

    parser = HfArgumentParser((PPOConfig,))
    (args,) = parser.parse_args_into_dataclasses(
        [
            "--output_dir",
            "out",
            "--use_cpu",
            "--per_device_train_batch_size",
            "4",
            "--num_ppo_epochs",
            "2",
            "--stop_token",
            "eos",
            "--kl_estimator",
            "k3",
            "--missing_eos_penalty",
            "1.0",
            "--bf16",
            "false",
            "--total_episodes",
            "100",
        ]
    )
    assert (
        args.per_device_train_batch_size,
        args.num_ppo_epochs,
        args.stop_token,
        args.kl_estimator,
        args.missing_eos_penalty,
        args.bf16,
        args.total_episodes,
    ) == (4, 2, "eos", "k3", 1.0, False, 100)
    text = parser.format_help()
    assert "--num_mini_batches" in text and "ppo.num_minibatches" in text  # lmppo's own help under the field
    with pytest.raises(SystemExit):
        parser.parse_args_into_dataclasses(["--output_dir", "o", "--use_cpu", "--kl_estimator", "k2"])


def args(**kw) -> PPOConfig:
    return PPOConfig(**{"output_dir": "unused", "use_cpu": True, "bf16": False, "report_to": "none", **kw})


REFUSED_VALUES = {
    "fp16": True,
    "lr_scheduler_kwargs": {"power": 2.0},
    "adam_beta1": 0.8,
    "adam_beta2": 0.99,
    "optim_args": "foo=1",
    "optim_target_modules": ["q_proj"],
    "include_num_input_tokens_seen": "all",
    "push_to_hub": True,
    "model_adapter_name": "train",
    "ref_adapter_name": "ref",
    "whiten_rewards": True,
    "ds3_gather_for_generation": False,
}


@pytest.mark.parametrize("name", sorted(REFUSED_VALUES))
def test_fields_lmppo_cannot_honour_are_errors_naming_them(name):
    value = REFUSED_VALUES[name]
    try:
        a = args(**{name: value})
    except ValueError:  # TrainingArguments itself refuses the value on this machine (fp16 needs a GPU)
        a = args()
        object.__setattr__(a, name, value)
    with pytest.raises(ConfigError, match=rf"`{name}` = .*TRL PPOConfig field"):
        check_fields(a)


def test_fsdp_is_refused_by_name():
    a = args()
    a.fsdp = "full_shard"
    with pytest.raises(ConfigError, match=r"`fsdp` = 'full_shard': lmppo has no FSDP support"):
        check_fields(a)


@pytest.mark.parametrize(
    "field_values, name",
    [
        ({"lr_scheduler_type": "polynomial"}, "lr_scheduler_type"),
        ({"optim": "sgd"}, "optim"),
        ({"save_strategy": "epoch"}, "save_strategy"),
        ({"missing_eos_penalty": 1.0}, "missing_eos_penalty"),  # no stop token
        ({"stop_token": "eos", "stop_token_id": 3}, "stop_token_id"),
    ],
)
def test_values_lmppo_cannot_honour_are_errors_naming_the_field(field_values, name):
    with pytest.raises(ConfigError, match=rf"`{name}`"):
        check_fields(args(**field_values))


def test_translation_to_lmppo_config_hand_worked():
    a = args(
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_mini_batches=2,
        total_episodes=20,
        warmup_steps=0.5,
        lr_scheduler_type="cosine",
        learning_rate=1e-5,
        adam_epsilon=1e-6,
        max_grad_norm=0.5,
        response_length=12,
        temperature=0.9,
        missing_eos_penalty=1.5,
        stop_token="eos",
        kl_coef=0.1,
        kl_estimator="k3",
        cliprange=0.3,
        cliprange_value=0.4,
        vf_coef=0.2,
        gamma=0.99,
        lam=0.9,
        num_ppo_epochs=3,
        local_rollout_forward_batch_size=8,
        save_steps=2,
        save_total_limit=3,
        seed=7,
    )
    c = lmppo_config(a, world_size=1, num_prompts=10, max_prompt_length=9, stop_token="eos")
    # batch = 4 x 2 x 1 process = 8; TRL trains ceil(20 / 8) = 3 updates -> 24 episodes
    assert (c.rollout.batch_size, c.total_episodes, c.num_iterations) == (8, 24, 3)
    assert (c.ppo.num_minibatches, c.ppo.micro_batch_size, c.grad_accumulation_steps) == (2, 4, 1)
    assert c.ppo.warmup_iterations == 2  # ceil(3 x 0.5)
    assert (c.ppo.lr_schedule, c.ppo.learning_rate, c.ppo.adam_eps, c.ppo.max_grad_norm) == ("cosine", 1e-5, 1e-6, 0.5)
    assert (c.rollout.max_new_tokens, c.rollout.temperature, c.rollout.stop_token, c.rollout.forward_batch_size) == (
        12,
        0.9 + 1e-7,
        "eos",
        8,
    )  # TRL samples at temperature + 1e-7
    assert (c.reward.truncation, c.reward.penalty, c.reward.penalty_mode) == ("penalty", -1.5, "add")
    assert (c.kl.coef, c.kl.estimator, c.kl.controller, c.kl.placement) == (0.1, "k3", "fixed", "reward")
    assert (c.ppo.clip_range, c.ppo.value_clip_range, c.ppo.vf_coef, c.ppo.gamma, c.ppo.lam, c.ppo.num_epochs) == (
        0.3,
        0.4,
        0.2,
        0.99,
        0.9,
        3,
    )
    assert (c.checkpoint.every, c.checkpoint.keep_last, c.seed, c.precision, c.device) == (2, 3, 7, "fp32", "cpu")
    assert (c.data.field, c.data.max_prompt_length, c.value.mode) == ("input_ids", 9, "critic")
    # total_episodes None: num_train_epochs x the training set (TRL's rule)
    c = lmppo_config(
        args(per_device_train_batch_size=4, num_train_epochs=2.0), world_size=1, num_prompts=10, max_prompt_length=4
    )
    assert c.total_episodes == 20 and c.num_iterations == 5 and c.rollout.stop_token == "none"
    assert lmppo_config(args(bf16=True), world_size=1, num_prompts=8, max_prompt_length=4).precision == "auto"
    # per_device 4, one minibatch of 2 per process: TRL runs one micro-batch of 2, lmppo too
    c = lmppo_config(
        args(per_device_train_batch_size=4, num_mini_batches=2), world_size=1, num_prompts=8, max_prompt_length=4
    )
    assert (c.minibatch_size, c.ppo.micro_batch_size) == (2, 2)
    # per_device 4, GA 3, 2 minibatches of 6: micro-batches of 3 (TRL: 4 and 2; the loss does not depend on the split)
    c = lmppo_config(
        args(per_device_train_batch_size=4, gradient_accumulation_steps=3, num_mini_batches=2),
        world_size=1,
        num_prompts=8,
        max_prompt_length=4,
    )
    assert (c.minibatch_size, c.ppo.micro_batch_size) == (6, 3)


# ----------------------------------------------------------------------------- PPOTrainer on tiny models


def seq_cls(tokenizer, seed):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForSequenceClassification(cfg)


def input_ids_dataset(tokenizer, texts):
    return datasets.Dataset.from_dict({"prompt": texts}).map(
        lambda row: {"input_ids": tokenizer(row["prompt"])["input_ids"]}, remove_columns=["prompt"]
    )


def trainer_args(tmp_path, **kw):
    return args(
        **{
            "output_dir": str(tmp_path / "out"),
            "per_device_train_batch_size": 4,
            "total_episodes": 8,
            "response_length": 5,
            "num_ppo_epochs": 2,
            "learning_rate": 1e-3,
            "stop_token": "eos",
            "local_rollout_forward_batch_size": 4,
            "per_device_eval_batch_size": 2,
            "num_sample_generations": 0,
            "save_strategy": "no",
            "disable_tqdm": True,
            **kw,
        }
    )


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


# ----------------------------------------------------------------------------- the migration guide

GUIDE = HERE.parent / "docs" / "migrating_from_trl.md"


def test_the_migration_guide_names_every_field():
    text = GUIDE.read_text(encoding="utf-8")
    missing = [f.name for f in dataclasses.fields(PPOConfig) if f"`{f.name}`" not in text]
    assert not missing


def test_the_migration_guide_yaml_is_a_valid_lmppo_config(tmp_path, tiny_model_dir, tiny_reward_model_dir, tokenizer):
    import re

    import yaml

    from lmppo.config import Config, from_dict

    block = re.search(r"```yaml\n(.*?)```", GUIDE.read_text(encoding="utf-8"), re.DOTALL).group(1)
    data = yaml.safe_load(block)
    ds = tmp_path / "prompts_ds"
    datasets.Dataset.from_dict({"input_ids": [tokenizer(p)["input_ids"] for p in PROMPTS]}).save_to_disk(str(ds))
    data["model"]["policy"] = tiny_model_dir
    data["data"]["prompts"] = str(ds)
    data["reward"]["sources"][0]["path"] = data["value"]["init_from"] = tiny_reward_model_dir
    cfg = from_dict(Config, data).validate()  # every key is a known field, every value allowed
    assert (cfg.kl.controller, cfg.reward.penalty_mode, cfg.value.mode) == ("fixed", "add", "critic")


def test_stop_token_id_becomes_that_token(tokenizer):
    from lmppo.trl.drop_in import _stop_token

    token_id = tokenizer.convert_tokens_to_ids(tokenizer.tokenize(" movie")[0])
    name = _stop_token(args(stop_token_id=token_id), tokenizer)
    assert tokenizer.convert_tokens_to_ids(name) == token_id
    assert _stop_token(args(stop_token="eos"), tokenizer) == "eos"
    assert _stop_token(args(), tokenizer) == "none"
    with pytest.raises(ConfigError, match="`stop_token_id`"):
        _stop_token(args(stop_token_id=len(tokenizer) + 5), tokenizer)


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


def test_trl_parser_reads_a_config_file_and_the_command_line(tmp_path):
    from lmppo.trl.drop_in import ModelConfig, ScriptArguments, TrlParser

    config = tmp_path / "ppo.yaml"
    config.write_text(
        "env: {LMPPO_TEST_VAR: seven}\nnum_ppo_epochs: 2\nlora_r: 8\ndataset_name: prompts_ds\n"
        "output_dir: from_file\nuse_cpu: true\nbf16: false\n"
    )
    parser = TrlParser((ScriptArguments, PPOConfig, ModelConfig))
    script_args, training_args, model_args = parser.parse_args_and_config(
        ["--config", str(config), "--num_ppo_epochs", "3"]
    )
    assert (script_args.dataset_name, training_args.num_ppo_epochs, training_args.output_dir, model_args.lora_r) == (
        "prompts_ds",
        3,
        "from_file",
        8,
    )
    assert os.environ.pop("LMPPO_TEST_VAR") == "seven"


def test_the_trl_style_example_script_runs_with_the_drop_in(tmp_path):
    """examples/trl_ppo_script.py (only its import line differs from its TRL 1.12 form) finishes under lmppo and its
    log_history has TRL's metric names."""
    script = HERE.parent / "examples" / "trl_ppo_script.py"
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [
            sys.executable,
            str(script),
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
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    history = json.loads((out / "log_history.json").read_text())
    assert len(history) == 2 and all(set(h) == TRL_LOG_HISTORY_KEYS for h in history)
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
