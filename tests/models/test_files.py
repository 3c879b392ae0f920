"""Model-folder checks before loading: each broken file named, with what is wrong with it."""

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from lmppo.models.files import (
    ModelFolderError,
    check_json_file,
    check_model_folder,
    check_safetensors,
    check_tokenizer_folder,
    is_adapter_folder,
)


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    save_file({"w": torch.zeros(4, 4)}, str(tmp_path / "model.safetensors"))
    return tmp_path


def test_a_complete_folder_passes(folder):
    check_model_folder(str(folder))
    assert not is_adapter_folder(str(folder))
    (folder / "adapter_config.json").write_text("{}")
    assert is_adapter_folder(str(folder))


def test_a_hub_id_is_not_checked_here():
    check_model_folder("org/not-a-local-folder")  # resolved and checked by the Hub loader


def test_missing_config_is_named(folder):
    os.remove(folder / "config.json")
    with pytest.raises(ModelFolderError, match="config.json is missing"):
        check_model_folder(str(folder))


def test_missing_weights_are_named(folder):
    os.remove(folder / "model.safetensors")
    with pytest.raises(ModelFolderError, match="model.safetensors is missing"):
        check_model_folder(str(folder))


def test_truncated_safetensors_gives_both_sizes(folder):
    path = folder / "model.safetensors"
    size = path.stat().st_size
    with open(path, "r+b") as fh:
        fh.truncate(size - 10)
    with pytest.raises(ModelFolderError, match=f"it has {size - 10} bytes, its header says {size}"):
        check_safetensors("model", str(folder), "model.safetensors")
    path.write_bytes(b"")
    with pytest.raises(ModelFolderError, match="is empty"):
        check_model_folder(str(folder))


def test_bad_json_names_line_and_column(folder):
    (folder / "config.json").write_text('{\n  "a": 1,\n  oops\n}')
    with pytest.raises(ModelFolderError, match=r"config.json is not valid JSON \(line 3, column 3"):
        check_json_file(str(folder), "config.json")
    (folder / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelFolderError, match="must hold a JSON object, not a list"):
        check_model_folder(str(folder))


def test_a_sharded_index_names_its_missing_shard(folder):
    os.remove(folder / "model.safetensors")
    index = {"weight_map": {"w": "model-00001-of-00002.safetensors", "v": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    save_file({"w": torch.zeros(2)}, str(folder / "model-00001-of-00002.safetensors"))
    with pytest.raises(ModelFolderError, match="model-00002-of-00002.safetensors is missing"):
        check_model_folder(str(folder))
    index["weight_map"]["v"] = "../elsewhere.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelFolderError, match="names a shard outside the folder"):
        check_model_folder(str(folder))


def test_a_tokenizer_folder_needs_tokenizer_files(tmp_path):
    with pytest.raises(ModelFolderError, match="holds no tokenizer files"):
        check_tokenizer_folder(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(ModelFolderError, match="tokenizer.json is not valid JSON"):
        check_tokenizer_folder(str(tmp_path))
