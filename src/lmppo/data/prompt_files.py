"""Reading a prompt file: ``.jsonl`` (one JSON object a line), ``.csv`` (a header row, then one row a prompt) or
``.txt`` (one prompt a line). Each problem is one ``DataError`` naming the file, the first bad line and what is
allowed: a line that is not JSON, a CSV row with more or fewer fields than the header, a missing prompt field.
``check_prompt_file`` refuses, before anything loads, a prompts path that is not a regular file or folder (a FIFO
would block the run on its first read; a device would read forever).
"""

from __future__ import annotations

import csv
import difflib
import io
import json
import os
import stat
from typing import Any, Sequence

from lmppo.config import DataConfig
from lmppo.errors import ConfigError, DataError

FORMATS = ("jsonl", "csv", "text")
EXTENSIONS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".txt": "text", ".text": "text"}


_KINDS = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def check_prompt_file(data_cfg: DataConfig) -> None:
    """ConfigError naming `data.prompts` when it is a path to something other than a regular file or a folder
    (read whole, a FIFO blocks until a writer comes and a device never ends). Follows symbolic links; a path that
    does not exist is left to the readers' own message."""
    path = data_cfg.prompts
    if not isinstance(path, str) or path.startswith("builtin:"):
        return
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return
    kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    raise ConfigError(
        "data.prompts",
        path,
        f"is {kind}, not a regular file; lmppo reads the prompts whole before training: write them to a "
        ".jsonl, .csv or .txt file (or a dataset folder) and give its path",
    )


def read_prompt_file(path: str, data_cfg: DataConfig) -> tuple[list, list[str], list[dict]]:
    """(records, their locations, their other columns) of a .jsonl / .csv / .txt prompt file; one DataError
    naming the file and the line for anything wrong."""
    check_prompt_file(data_cfg)
    if not os.path.exists(path):
        raise DataError(
            f"prompt file `{path}` does not exist (data.prompts takes a .jsonl, .csv or .txt file, or "
            "`builtin:reviews` / `builtin:news`)"
        )
    if os.path.isdir(path):
        raise DataError(
            f"prompt file `{path}` is a folder; with data.format `{data_cfg.format}` data.prompts takes a "
            ".jsonl, .csv or .txt file (a save_to_disk folder needs data.format `auto` or `dataset`)"
        )
    fmt = data_cfg.format
    if fmt == "auto":
        ext = os.path.splitext(path)[1].lower()
        if ext not in EXTENSIONS:
            raise DataError(
                f"prompt file `{path}`: cannot tell the format from the extension `{ext or '(none)'}`; "
                "use .jsonl, .csv or .txt, or set data.format to `jsonl`, `csv` or `text`"
            )
        fmt = EXTENSIONS[ext]
    if fmt not in FORMATS:
        raise DataError(f"data.format = {fmt!r}: must be `auto`, `jsonl`, `csv` or `text`")
    with open(path, "rb") as fh:
        raw = fh.read()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        offset = err.start
        line = raw[:offset].count(b"\n") + 1
        raise DataError(
            f"prompt file `{path}` is not UTF-8 text: byte {raw[offset : offset + 1]!r} at byte offset "
            f"{offset} (line {line}) cannot be decoded; save the file as UTF-8"
        ) from None
    if not text.strip():
        raise DataError(f"prompt file `{path}` is empty")
    reader = {"jsonl": _read_jsonl, "csv": _read_csv, "text": _read_text}[fmt]
    return reader(text, path, data_cfg.field)


def _read_text(text: str, path: str, field_name: str) -> tuple[list, list[str], list[dict]]:
    items, locations = [], []
    for n, line in enumerate(_lines(text), start=1):
        if line.strip():
            items.append(line)
            locations.append(f"line {n}")
    return items, locations, [{} for _ in items]


def _read_jsonl(text: str, path: str, field_name: str) -> tuple[list, list[str], list[dict]]:
    items, locations, columns = [], [], []
    for n, line in enumerate(_lines(text), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(
                f"{path}, line {n}: not valid JSON ({err.msg} at column {err.colno}): {short_repr(line)}"
            ) from None
        except RecursionError:
            raise DataError(f"{path}, line {n}: JSON nested too deeply to read: {short_repr(line)}") from None
        if not isinstance(row, dict):
            raise DataError(
                f"{path}, line {n}: expected a JSON object with field `{field_name}`, got a "
                f"{type(row).__name__}: {short_repr(line)}"
            )
        if field_name not in row:
            raise DataError(
                f"{path}, line {n}: no field `{field_name}`; the line has fields {field_names(row)}"
                f"{did_you_mean(field_name, list(row))}; data.field names the field that holds the prompt"
            )
        items.append(row[field_name])
        locations.append(f"line {n}")
        columns.append({k: v for k, v in row.items() if k != field_name})
    return items, locations, columns


def _read_csv(text: str, path: str, field_name: str) -> tuple[list, list[str], list[dict]]:
    try:
        return _read_csv_rows(text, path, field_name)
    except csv.Error as err:
        raise DataError(f"{path}: not readable as CSV ({err}); check quoting, or use a .jsonl file") from None


def _read_csv_rows(text: str, path: str, field_name: str) -> tuple[list, list[str], list[dict]]:
    reader = csv.DictReader(io.StringIO(text, newline=""))
    header = reader.fieldnames or []
    if field_name not in header:
        raise DataError(
            f"{path}, line 1: no column `{field_name}`; the header has columns {field_names(header)}"
            f"{did_you_mean(field_name, header)}; data.field names the column that holds the prompt"
        )
    lines = _lines(text)
    items, locations, columns = [], [], []
    line = reader.line_num
    for row in reader:
        start, line = line + 1, reader.line_num
        while start < line and lines[start - 1] == "":  # empty lines before the row (csv skips them)
            start += 1
        fields = sum(v is not None for k, v in row.items() if k is not None) + len(row.get(None) or [])
        if None in row or any(v is None for k, v in row.items() if k is not None):
            raise DataError(
                f"{path}, line {start}: the row has {fields} field{'s' if fields != 1 else ''}, the header has "
                f"{len(header)}; every row needs one value per column (quote a value that holds a comma)"
            )
        items.append(row[field_name])
        locations.append(f"line {start}")
        columns.append({k: v for k, v in row.items() if k != field_name})
    return items, locations, columns


def _lines(text: str) -> list[str]:
    """Lines split on newlines only (str.splitlines would also split JSON strings holding U+2028)."""
    return [line[:-1] if line.endswith("\r") else line for line in text.split("\n")]


# ----------------------------------------------------------------------------- helpers


def short_repr(x: Any, n: int = 60) -> str:
    r = repr(x)
    return r if len(r) <= n else r[: n - 3] + "..."


def field_names(row: Any) -> str:
    keys = list(row)
    shown = ", ".join(f"`{k}`" for k in keys[:12])
    return (shown + (", ..." if len(keys) > 12 else "")) or "(none)"


def did_you_mean(name: str, options: Sequence[str]) -> str:
    hint = difflib.get_close_matches(name, [str(o) for o in options], n=1)
    return f" (`{hint[0]}` is close: a typo?)" if hint else ""
