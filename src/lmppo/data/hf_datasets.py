"""Prompts from Hugging Face `datasets`: a ``datasets.Dataset`` object, a folder written by ``save_to_disk``, or
Parquet / Arrow files.

The column that holds the prompts is ``data.field``. A column may hold text (a string per row), chat messages (a
list of ``{"role", "content"}`` per row, e.g. a ``messages`` column) or token ids (a list of integers per row, e.g.
TRL's pre-tokenized ``input_ids``); the records then go through the same checks as every other prompt source
(``lmppo.data.prompts``). When ``data.field`` is left at its default ``prompt`` and the dataset has no such column, the
first
of ``messages``, ``input_ids`` and ``text`` that it has is used (TRL's PPO datasets carry ``input_ids``).

``datasets`` is an optional dependency (``pip install lmppo[datasets]``), imported only here and only when such a
source is used.
"""

from __future__ import annotations

import os
from typing import Any

from lmppo.errors import DataError

FALLBACK_COLUMNS = ("messages", "input_ids", "text")
"""Columns tried, in order, when `data.field` is the default `prompt` and the dataset has no `prompt` column."""
DEFAULT_FIELD = "prompt"
DATASET_FORMATS = ("dataset", "parquet", "arrow")
"""`data.format` values read through `datasets`: a `save_to_disk` folder, Parquet files, Arrow files."""
DATASET_EXTENSIONS = {".parquet": "parquet", ".arrow": "arrow"}


def import_datasets() -> Any:
    """The `datasets` module, or a DataError saying how to install it."""
    try:
        import datasets
    except ImportError:
        raise DataError(
            "reading Hugging Face datasets (a Dataset object, a save_to_disk folder, Parquet or Arrow "
            "files) needs the `datasets` package: pip install 'lmppo[datasets]' (or pip install "
            "datasets)"
        ) from None
    return datasets


def is_hf_dataset(obj: Any) -> bool:
    """True for a `datasets.Dataset` / `DatasetDict` / `IterableDataset` object (checked without importing
    `datasets`, so that plain lists never pull it in)."""
    return type(obj).__module__.split(".")[0] == "datasets"


def dataset_format(path: str, fmt: str) -> str | None:
    """The `datasets` format of a prompt path (`dataset`, `parquet`, `arrow`), or None when it is another kind."""
    if fmt in DATASET_FORMATS:
        return fmt
    if fmt != "auto":
        return None
    if os.path.isdir(path):
        return "dataset"
    return DATASET_EXTENSIONS.get(os.path.splitext(path)[1].lower())


def load_dataset_path(path: str, fmt: str) -> Any:
    """A `datasets.Dataset` read from `path`: a `save_to_disk` folder (`dataset`), or a Parquet / Arrow file, or a
    folder of such files (`parquet`, `arrow`)."""
    datasets = import_datasets()
    if not os.path.exists(path):
        raise DataError(f"prompt dataset `{path}` does not exist")
    if fmt == "dataset":
        if not os.path.isdir(path):
            raise DataError(
                f"prompt dataset `{path}`: data.format `dataset` takes a folder written by "
                "Dataset.save_to_disk; for a single file use .parquet / .arrow"
            )
        try:
            ds = datasets.load_from_disk(path)
        except FileNotFoundError as err:
            files = sorted(os.listdir(path))[:8]
            raise DataError(
                f"prompt dataset `{path}` is not a folder written by save_to_disk ({err}); it holds "
                f"{files}. For a folder of Parquet or Arrow files set data.format to `parquet` or "
                "`arrow`"
            ) from None
        return ds
    if os.path.isdir(path):
        ext = "." + fmt
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(ext))
        if not files:
            raise DataError(f"prompt dataset `{path}`: the folder holds no {ext} files")
    else:
        files = [path]
    try:
        loaded = datasets.load_dataset(fmt, data_files=files, split="train")
    except Exception as err:  # noqa: BLE001 - pyarrow / datasets raise many kinds for unreadable files
        raise DataError(f"prompt dataset `{path}`: cannot be read as {fmt} ({type(err).__name__}: {err})") from None
    return loaded


def dataset_records(ds: Any, field: str, source: str) -> tuple[list, list[str], str, list[dict]]:
    """(records, locations, column, columns) of dataset `ds`: the prompt column's values, and for each row its
    other columns by name (they reach the reward functions that ask for them; `source` names `ds` in messages)."""
    datasets = import_datasets()
    if isinstance(ds, datasets.DatasetDict):
        raise DataError(
            f"{source} is a DatasetDict with splits {_names(list(ds))}; give one split "
            f"(e.g. dataset[{next(iter(ds), 'train')!r}])"
        )
    if isinstance(ds, datasets.IterableDataset):
        raise DataError(
            f"{source} is an IterableDataset (streaming); lmppo needs the whole prompt set: load it without streaming"
        )
    if not isinstance(ds, datasets.Dataset):
        raise DataError(f"{source} is a {type(ds).__name__}; expected a datasets.Dataset")
    columns = list(ds.column_names)
    column = field
    if field not in columns:
        fallback = next((c for c in FALLBACK_COLUMNS if c in columns), None) if field == DEFAULT_FIELD else None
        if fallback is None:
            raise DataError(
                f"{source}: no column `{field}`; the dataset has columns {_names(columns)}; data.field "
                "names the column that holds the prompt (text, chat messages or token ids)"
            )
        column = fallback
    if len(ds) == 0:
        raise DataError(f"{source}: holds no rows")
    values = ds[column]
    if not isinstance(values, list):  # datasets >= 4 returns a lazy Column
        values = list(values)
    items = [_plain(v) for v in values]
    others = {name: ds[name] for name in columns if name != column}
    rows = [{name: _plain(vals[i]) for name, vals in others.items()} for i in range(len(items))]
    return items, [f"row {i}" for i in range(len(items))], column, rows


def _plain(value: Any) -> Any:
    """Python values from what a `datasets` column gives back (lists of ints, dicts of messages, strings)."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, tuple):
        value = list(value)
    return value


def _names(keys: list) -> str:
    return ", ".join(f"`{k}`" for k in keys[:12]) + (", ..." if len(keys) > 12 else "") or "(none)"
