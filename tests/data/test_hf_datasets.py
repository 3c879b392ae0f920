"""Hugging Face `datasets` as a prompt source (lmppo.data.hf_datasets through lmppo.data.prompts and the trainer)."""

from __future__ import annotations

import pytest

datasets = pytest.importorskip("datasets")

from conftest import PROMPTS, small_config, tiny_llama  # noqa: E402
from lmppo.config import Config, DataConfig  # noqa: E402
from lmppo.data.prompts import load_prompt_records, tokenize_prompts  # noqa: E402
from lmppo.errors import ConfigError, DataError  # noqa: E402

MESSAGES = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Review the film."}],
    [{"role": "user", "content": "Say hello."}],
]


def text_ds():
    return datasets.Dataset.from_dict({"prompt": PROMPTS[:4], "id": [0, 1, 2, 3]})


def test_dataset_object_text_column(tokenizer):
    records = load_prompt_records(DataConfig(), text_ds())
    assert list(records) == PROMPTS[:4]
    assert "column `prompt`" in records.source
    ids = tokenize_prompts(records, tokenizer, DataConfig()).ids
    assert ids == [tokenizer(p)["input_ids"] for p in PROMPTS[:4]]


def test_dataset_object_messages_column_gets_the_chat_template(tokenizer):
    ds = datasets.Dataset.from_dict({"messages": MESSAGES})
    records = load_prompt_records(DataConfig(), ds)  # `prompt` missing: falls back to `messages`
    assert records[0] == MESSAGES[0] and records[1] == MESSAGES[1]
    ids = tokenize_prompts(records, tokenizer, DataConfig(max_prompt_length=256)).ids
    expected = tokenizer.apply_chat_template(MESSAGES[1], add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids[1] == list(expected)


def test_dataset_object_pretokenized_input_ids_used_as_given(tokenizer):
    rows = [tokenizer(p)["input_ids"] for p in PROMPTS[:3]]
    ds = datasets.Dataset.from_dict({"input_ids": rows})
    records = load_prompt_records(DataConfig(), ds)
    assert [list(r) for r in records] == rows
    assert tokenize_prompts(records, tokenizer, DataConfig()).ids == rows


def test_explicit_field_and_a_missing_column():
    ds = datasets.Dataset.from_dict({"question": ["a b", "c d"], "prompt": ["x", "y"]})
    assert list(load_prompt_records(DataConfig(field="question"), ds)) == ["a b", "c d"]
    with pytest.raises(DataError, match=r"no column `query`.*`question`, `prompt`"):
        load_prompt_records(DataConfig(field="query"), ds)
    with pytest.raises(DataError, match="no column `prompt`"):
        load_prompt_records(DataConfig(), datasets.Dataset.from_dict({"question": ["a"]}))


def test_the_other_columns_travel_with_each_prompt(tmp_path):
    ds = datasets.Dataset.from_dict({"prompt": ["1 + 2 =", "3 + 4 ="], "solution": ["3", "7"], "level": [1, 2]})
    records = load_prompt_records(DataConfig(), ds)
    assert list(records) == ["1 + 2 =", "3 + 4 ="]
    assert records.columns == [{"solution": "3", "level": 1}, {"solution": "7", "level": 2}]
    ds.save_to_disk(str(tmp_path / "ds"))  # the same from a save_to_disk folder
    assert load_prompt_records(DataConfig(prompts=str(tmp_path / "ds")), None).columns == records.columns


def test_dataset_dict_and_bad_rows_are_refused():
    dd = datasets.DatasetDict({"train": text_ds(), "test": text_ds()})
    with pytest.raises(DataError, match=r"DatasetDict with splits `train`, `test`; give one split"):
        load_prompt_records(DataConfig(), dd)
    with pytest.raises(DataError, match=r"row 1: the prompt is an empty string"):
        load_prompt_records(DataConfig(), datasets.Dataset.from_dict({"prompt": ["fine", " "]}))


def test_save_to_disk_folder(tmp_path):
    folder = tmp_path / "prompts_ds"
    text_ds().save_to_disk(str(folder))
    records = load_prompt_records(DataConfig(prompts=str(folder)))  # format auto: a folder is a dataset
    assert list(records) == PROMPTS[:4]
    assert list(load_prompt_records(DataConfig(prompts=str(folder), format="dataset"))) == PROMPTS[:4]


def test_parquet_and_arrow_files(tmp_path, tokenizer):
    rows = [tokenizer(p)["input_ids"] for p in PROMPTS[:5]]
    ds = datasets.Dataset.from_dict({"input_ids": rows, "prompt": PROMPTS[:5]})
    ds.to_parquet(str(tmp_path / "p.parquet"))
    assert list(load_prompt_records(DataConfig(prompts=str(tmp_path / "p.parquet")))) == PROMPTS[:5]
    got = load_prompt_records(DataConfig(prompts=str(tmp_path / "p.parquet"), field="input_ids"))
    assert [list(r) for r in got] == rows
    # an Arrow file (the format save_to_disk writes its shards in)
    folder = tmp_path / "saved"
    ds.save_to_disk(str(folder))
    arrow = next(folder.glob("*.arrow"))
    assert list(load_prompt_records(DataConfig(prompts=str(arrow)))) == PROMPTS[:5]
    # a folder of Parquet files
    (tmp_path / "shards").mkdir()
    ds.select(range(2)).to_parquet(str(tmp_path / "shards" / "a.parquet"))
    ds.select(range(2, 5)).to_parquet(str(tmp_path / "shards" / "b.parquet"))
    assert list(load_prompt_records(DataConfig(prompts=str(tmp_path / "shards"), format="parquet"))) == PROMPTS[:5]


def test_unreadable_files_and_folders(tmp_path):
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match=r"bad.parquet`: cannot be read as parquet"):
        load_prompt_records(DataConfig(prompts=str(bad)))
    plain = tmp_path / "plain_folder"
    plain.mkdir()
    (plain / "notes.txt").write_text("x")
    with pytest.raises(DataError, match="is not a folder written by save_to_disk"):
        load_prompt_records(DataConfig(prompts=str(plain)))


def test_config_accepts_dataset_formats(tmp_path):
    folder = tmp_path / "ds"
    text_ds().save_to_disk(str(folder))
    cfg = Config()
    cfg.data.prompts, cfg.data.format = str(folder), "dataset"
    cfg.validate()
    with pytest.raises(ConfigError, match="data.format"):  # refused on assignment
        cfg.data.format = "feather"


def test_trainer_trains_on_a_dataset_object_and_a_dataset_folder(tmp_path, tokenizer):
    from lmppo.training.trainer import PPOTrainer

    def length(prompts, completions):
        return [len(c) / 10 for c in completions]

    cfg = small_config(tmp_path / "obj", iterations=1)
    trainer = PPOTrainer(
        cfg,
        policy=tiny_llama(tokenizer),
        tokenizer=tokenizer,
        prompts=datasets.Dataset.from_dict({"prompt": PROMPTS}),
        reward_functions=[length],
    )
    assert sorted(trainer.prompt_set.texts) == sorted(
        tokenizer.batch_decode([tokenizer(p)["input_ids"] for p in PROMPTS])
    )
    assert len(trainer.train()) == 1
    folder = tmp_path / "prompts_ds"
    datasets.Dataset.from_dict({"prompt": PROMPTS}).save_to_disk(str(folder))
    cfg = small_config(tmp_path / "folder", iterations=1)
    cfg.data.prompts = str(folder)
    trainer = PPOTrainer(cfg, policy=tiny_llama(tokenizer), tokenizer=tokenizer, reward_functions=[length])
    assert len(trainer.prompt_set.ids) == len(PROMPTS)
    assert len(trainer.train()) == 1
