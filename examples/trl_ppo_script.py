"""A TRL-1.12-style PPO script: HfArgumentParser((ScriptArguments, PPOConfig, ModelConfig)), a policy, a reference
policy, a reward model and a value model built with `Auto*`-style classes, a pre-tokenized `datasets.Dataset` with an
`input_ids` column, then PPOTrainer(...).train(), save_model(), generate_completions().

It runs unchanged under TRL 1.12 and under lmppo; only the import line below differs:

    from trl.experimental.ppo import PPOConfig, PPOTrainer     # TRL 1.12
    from lmppo.trl import PPOConfig, PPOTrainer                # lmppo

The models are tiny Llamas built here (no downloads) with a word-level tokenizer, so it runs on a CPU in seconds::

    python examples/trl_ppo_script.py --output_dir runs/trl_script --use_cpu --bf16 false --report_to none \
        --per_device_train_batch_size 4 --total_episodes 16 --response_length 8 --num_ppo_epochs 2 \
        --stop_token eos --missing_eos_penalty 1.0 --learning_rate 1e-4 --local_rollout_forward_batch_size 4 \
        --per_device_eval_batch_size 4 --num_sample_generations 2 --save_strategy no

It writes OUTPUT_DIR/log_history.json (the trainer's `state.log_history`) and prints the logged metric names. The same
command plus `--resume_from_checkpoint OUTPUT_DIR` continues the run from its latest checkpoint (lmppo only; TRL 1.12's
script removes OUTPUT_DIR first and its PPOTrainer does not resume).
"""

import json
import os
import shutil
from dataclasses import dataclass, field

import torch
from datasets import Dataset
from transformers import (
    HfArgumentParser,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    PreTrainedTokenizerFast,
    TrainerCallback,
)

from lmppo.trl import PPOConfig, PPOTrainer

WORDS = (
    "the a movie film story actor plot ending scene music was is felt seemed looked very quite good bad great "
    "awful fine dull bright and but so because we they it really not long short funny sad"
).split()
SENTENCES = [
    "the movie was",
    "the film is",
    "the story seemed",
    "the actor looked",
    "the plot was very",
    "the ending felt",
    "a scene was",
    "the music is",
    "we felt the movie was",
    "they said the film is",
    "it was a long",
    "the story is really",
    "a funny scene",
    "the sad ending",
    "the actor was quite",
    "the plot is so",
    "we felt it was",
    "the music was very",
    "a long film but",
    "the ending is not",
]


@dataclass
class ScriptArguments:
    """Data of this example (TRL's scripts name a hub dataset here; this one builds its own)."""

    num_eval_prompts: int = field(default=4, metadata={"help": "Prompts held out as the eval_dataset."})


@dataclass
class ModelConfig:
    """The tiny models this example builds (TRL's scripts load them by name)."""

    hidden_size: int = field(default=32, metadata={"help": "Hidden size of the tiny Llama models."})
    num_layers: int = field(default=2, metadata={"help": "Layers of the tiny Llama models."})
    model_seed: int = field(default=0, metadata={"help": "Seed of the tiny models' initial weights."})


def build_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(["[PAD]", "[EOS]", "[UNK]"] + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="[PAD]", eos_token="[EOS]", unk_token="[UNK]", padding_side="left"
    )
    return tok


def llama_config(tok, m: ModelConfig, **extra) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tok),
        hidden_size=m.hidden_size,
        intermediate_size=2 * m.hidden_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
        **extra,
    )


class RecordLogs(TrainerCallback):
    """A user callback, as TRL scripts add them: sees every `on_log`."""

    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))


if __name__ == "__main__":
    parser = HfArgumentParser((ScriptArguments, PPOConfig, ModelConfig))
    script_args, training_args, model_args = parser.parse_args_into_dataclasses()
    if not training_args.resume_from_checkpoint:  # TRL's script starts afresh; lmppo can continue the run folder
        shutil.rmtree(training_args.output_dir, ignore_errors=True)

    ################
    # Model & Tokenizer
    ################
    tokenizer = build_tokenizer()
    torch.manual_seed(model_args.model_seed)
    policy = LlamaForCausalLM(llama_config(tokenizer, model_args))
    ref_policy = LlamaForCausalLM(llama_config(tokenizer, model_args))
    ref_policy.load_state_dict(policy.state_dict())
    reward_model = LlamaForSequenceClassification(llama_config(tokenizer, model_args, num_labels=1))
    value_model = LlamaForSequenceClassification(llama_config(tokenizer, model_args, num_labels=1))
    value_model.load_state_dict(reward_model.state_dict())

    ################
    # Dataset
    ################
    dataset = Dataset.from_dict({"prompt": SENTENCES})
    eval_samples = script_args.num_eval_prompts
    train_dataset = dataset.select(range(len(dataset) - eval_samples))
    eval_dataset = dataset.select(range(len(dataset) - eval_samples, len(dataset)))

    def prepare_dataset(dataset, tokenizer):
        """pre-tokenize the dataset before training; only collate during training"""

        def tokenize(element):
            outputs = tokenizer(element["prompt"], padding=False)
            return {"input_ids": outputs["input_ids"]}

        return dataset.map(tokenize, batched=True, remove_columns=dataset.column_names)

    train_dataset = prepare_dataset(train_dataset, tokenizer)
    eval_dataset = prepare_dataset(eval_dataset, tokenizer)

    ################
    # Training
    ################
    recorder = RecordLogs()
    trainer = PPOTrainer(
        args=training_args,
        processing_class=tokenizer,
        model=policy,
        ref_model=ref_policy,
        reward_model=reward_model,
        value_model=value_model,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        callbacks=[recorder],
    )
    trainer.train()

    trainer.save_model(training_args.output_dir)
    trainer.generate_completions()

    history = trainer.state.log_history
    os.makedirs(training_args.output_dir, exist_ok=True)
    with open(os.path.join(training_args.output_dir, "log_history.json"), "w") as fh:
        json.dump(history, fh, indent=1, default=float)
    print(f"updates logged: {len(history)}; callback on_log calls: {len(recorder.logs)}")
    print("log_history metric names:", sorted(history[-1]))
