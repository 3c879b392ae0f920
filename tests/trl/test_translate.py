"""lmppo.trl.translate: the fields lmppo refuses, the translation to lmppo's config worked by hand, the guide's YAML."""

from __future__ import annotations

import os

import pytest

from conftest import PROMPTS
from lmppo.errors import ConfigError
from lmppo.trl import check_fields, lmppo_config
from trl_support import HERE, args

datasets = pytest.importorskip("datasets")
GUIDE = HERE.parent / "docs" / "migrating_from_trl.md"


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
        ({"stop_token": "eos", "stop_token_id": 3}, "stop_token_id"),
        ({"per_device_train_batch_size": 4, "num_mini_batches": 3}, "num_mini_batches"),  # 4 % 3: before any model
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
    from lmppo.trl.translate import stop_token_name

    token_id = tokenizer.convert_tokens_to_ids(tokenizer.tokenize(" movie")[0])
    name = stop_token_name(args(stop_token_id=token_id), tokenizer)
    assert tokenizer.convert_tokens_to_ids(name) == token_id
    assert stop_token_name(args(stop_token="eos"), tokenizer) == "eos"
    assert stop_token_name(args(), tokenizer) == "none"
    with pytest.raises(ConfigError, match="`stop_token_id`"):
        stop_token_name(args(stop_token_id=len(tokenizer) + 5), tokenizer)


def test_fields_set_without_effect_are_named_one_line_per_group():
    from lmppo.trl.translate import ignored_fields

    assert ignored_fields(args()) == []  # TRL's defaults: nothing to say
    assert ignored_fields(args(sft_model_path="my/sft", dataset_num_proc=4, tf32=None)) == []  # read by scripts
    lines = ignored_fields(
        args(
            max_steps=5,
            eval_strategy="steps",
            eval_steps=3,
            logging_steps=2,
            neftune_noise_alpha=5.0,
            use_liger_kernel=True,
            hub_model_id="me/model",
            data_seed=3,
        )
    )
    assert [line.split(":")[0] for line in lines] == [
        "run length",
        "evaluation",
        "logging",
        "speed and kernels",
        "randomness",
        "the Hub",
    ]
    assert lines[0].startswith("run length: max_steps=5 (a PPO run lasts total_episodes")
    assert lines[1].startswith("evaluation: eval_strategy='steps', eval_steps=3 (")
    assert lines[3].startswith("speed and kernels: use_liger_kernel=True, neftune_noise_alpha=5.0 (")
    assert lines[5].startswith("the Hub: hub_model_id='me/model' (nothing is uploaded")


def test_gradient_checkpointing_becomes_lmppos_option():
    def config(**kw):
        return lmppo_config(args(**kw), world_size=1, num_prompts=8, max_prompt_length=4)

    assert config().model.gradient_checkpointing is True  # TRL's default, True
    assert config(gradient_checkpointing=False).model.gradient_checkpointing is False
    assert config(activation_checkpointing=False).model.gradient_checkpointing is False  # transformers' new name


def test_resume_from_checkpoint_names_this_runs_folder(tmp_path):
    from lmppo.trl.translate import resume_folder

    out = str(tmp_path / "run")
    with pytest.raises(ConfigError, match=r"`resume_from_checkpoint` = 'true': no such folder: .*run"):
        args(output_dir=out, resume_from_checkpoint="true")  # refused when the arguments are parsed
    os.makedirs(out)
    assert resume_folder(args(output_dir=out)) is None
    assert resume_folder(args(output_dir=out, resume_from_checkpoint="false")) is None
    assert resume_folder(args(output_dir=out, resume_from_checkpoint="true")) == out
    assert resume_folder(args(output_dir=out, resume_from_checkpoint=out + "/")) == out
    with pytest.raises(ConfigError, match=r"`resume_from_checkpoint` = .*other.*must be this run's output_dir"):
        check_fields(args(output_dir=out, resume_from_checkpoint=str(tmp_path / "other")))


def test_refused_fields_are_refused_when_the_arguments_are_parsed():
    """HfArgumentParser builds the PPOConfig before a script loads any model: the refusal comes then."""
    from transformers import HfArgumentParser

    from lmppo.trl import PPOConfig

    parser = HfArgumentParser(PPOConfig)
    with pytest.raises(ConfigError, match=r"`whiten_rewards` = True: lmppo does not whiten"):
        parser.parse_args_into_dataclasses(["--output_dir", "x", "--use_cpu", "--whiten_rewards", "true"])


def test_missing_eos_penalty_without_a_stop_token_is_trls_rule():
    """No stop token: no truncation policy (responses run to response_length); the trainer adds the penalty as a
    reward source, -penalty for each response with no eos token (TRL 1.12: scores[~contain_eos_token] -= penalty)."""
    from lmppo.trl.trainer import MissingEosPenalty

    c = lmppo_config(args(missing_eos_penalty=1.5), world_size=1, num_prompts=8, max_prompt_length=4)
    assert (c.rollout.stop_token, c.reward.truncation) == ("none", "none")
    eos = 2
    assert MissingEosPenalty(eos, 1.5)([[5, 6, 7], [5, 2, 7], [2], [9, 9, 2]]) == [-1.5, 0.0, 0.0, 0.0]
    with_stop = lmppo_config(
        args(missing_eos_penalty=1.5, stop_token="eos"),
        world_size=1,
        num_prompts=8,
        max_prompt_length=4,
        stop_token="eos",
    )
    assert (with_stop.reward.truncation, with_stop.reward.penalty, with_stop.reward.penalty_mode) == (
        "penalty",
        -1.5,
        "add",
    )
    with pytest.raises(ConfigError, match="`missing_eos_penalty` = 1.5: needs a tokenizer with an eos token"):
        MissingEosPenalty(None, 1.5)
