"""Prompt loading, tokenization and the prompt order (lmppo.data.prompts)."""

from __future__ import annotations

import json
import os
import warnings

import pytest

from helpers_tokenizers import make_bpe_tokenizer
from lmppo.config import DataConfig
from lmppo.data.prompt_files import check_prompt_file
from lmppo.data.prompts import PromptRecords, PromptStream, load_prompt_records, tokenize_prompts
from lmppo.errors import ConfigError, DataError


@pytest.fixture(scope="module")
def tok():
    return make_bpe_tokenizer()


def write(tmp_path, name, content, mode="w"):
    path = tmp_path / name
    if mode == "wb":
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return str(path)


def cfg(path="", **kw):
    return DataConfig(prompts=path, **kw)


# ----------------------------------------------------------------------------- loading: good input


def test_jsonl_all_record_forms(tmp_path):
    lines = [
        json.dumps({"prompt": "The movie was", "id": 1}),
        "",
        json.dumps({"prompt": [{"role": "user", "content": "Hi there"}]}),
        json.dumps({"prompt": [5, 6, 7]}),
    ]
    path = write(tmp_path, "p.jsonl", "\n".join(lines) + "\n")
    recs = load_prompt_records(cfg(path))
    assert isinstance(recs, PromptRecords) and isinstance(recs, list)
    assert recs == ["The movie was", [{"role": "user", "content": "Hi there"}], [5, 6, 7]]
    assert recs.where(1) == f"{path}, line 3"  # the blank line is skipped but counted


def test_jsonl_custom_field_and_u2028_inside_a_string(tmp_path):
    path = write(tmp_path, "p.jsonl", json.dumps({"text": "a\u2028b"}, ensure_ascii=False) + "\n")
    assert load_prompt_records(cfg(path, field="text")) == ["a\u2028b"]


def test_csv_and_text_and_format_override(tmp_path):
    csv_path = write(tmp_path, "p.csv", 'id,prompt\n1,"Hello, world"\n2,"two\nlines"\n3,last\n')
    recs = load_prompt_records(cfg(csv_path))
    assert recs == ["Hello, world", "two\nlines", "last"]
    assert recs.locations == ["line 2", "line 3", "line 5"]  # a quoted newline makes a row two lines long
    txt = write(tmp_path, "p.txt", "first prompt\n\n  \nsecond prompt\r\n")
    assert load_prompt_records(cfg(txt)) == ["first prompt", "second prompt"]
    other = write(tmp_path, "p.dat", "only line\n")
    assert load_prompt_records(cfg(other, format="text")) == ["only line"]


def test_utf8_bom_is_accepted(tmp_path):
    path = write(tmp_path, "p.txt", "\ufeffhello\n".encode("utf-8"), mode="wb")
    assert load_prompt_records(cfg(path)) == ["hello"]


def test_api_list_and_builtin(monkeypatch):
    recs = load_prompt_records(cfg("unused.txt"), prompts=["a b", [1, 2]])
    assert recs == ["a b", [1, 2]]
    monkeypatch.setattr("lmppo.models.assets.builtin_records", lambda name: [f"{name} one", f"{name} two"])
    assert load_prompt_records(cfg("builtin:reviews")) == ["reviews one", "reviews two"]


# ----------------------------------------------------------------------------- loading: bad input


@pytest.mark.parametrize(
    "name,content,expected",
    [
        ("empty.txt", "", "is empty"),
        ("blank.txt", "\n  \n\n", "is empty"),
        ("bad.jsonl", '{"prompt": "ok"}\n{"prompt": "x",}\n', r"bad.jsonl, line 2: not valid JSON"),
        ("list.jsonl", '["a"]\n', r"line 1: expected a JSON object with field `prompt`, got a list"),
        (
            "nofield.jsonl",
            '{"prompt": "ok"}\n{"promt": "x", "id": 3}\n',
            r"line 2: no field `prompt`; the line has fields `promt`, `id` \(`promt` is close: a typo\?\); data.field ",
        ),
        ("num.jsonl", '{"prompt": 3.5}\n', r"line 1: the prompt is 3.5 \(float\); must be a string"),
        ("dict.jsonl", '{"prompt": {"a": 1}}\n', r"line 1: the prompt is \{'a': 1\} \(dict\)"),
        ("emptystr.jsonl", '{"prompt": "ok"}\n{"prompt": "  "}\n', r"line 2: the prompt is an empty string"),
        ("emptylist.jsonl", '{"prompt": []}\n', r"line 1: the prompt is an empty list"),
        ("mixed.jsonl", '{"prompt": [1, "a"]}\n', r"line 1: item 1 of the list is 'a' \(str\)"),
        ("bool.jsonl", '{"prompt": [1, true]}\n', r"line 1: item 1 of the list is True"),
        ("norole.jsonl", '{"prompt": [{"content": "hi"}]}\n', r"line 1: chat message 0 has no `role`"),
        (
            "nocontent.jsonl",
            '{"prompt": [{"role": "user", "content": "a"}, {"role": "user"}]}\n',
            r"line 1: chat message 1 has no `content` \(it has `role`\)",
        ),
        ("badcontent.jsonl", '{"prompt": [{"role": "user", "content": 5}]}\n', r"chat message 0 has content 5"),
        ("nocol.csv", "id,text\n1,hello\n", r"line 1: no column `prompt`; the header has columns `id`, `text`"),
        ("emptycell.csv", "id,prompt\n1,hello\n2,\n", r"emptycell.csv, line 3: the prompt is an empty string"),
        ("short.csv", "id,prompt\n1,hello\n2\n", r"short.csv, line 3: the row has 1 field, the header has 2"),
        ("shortlast.csv", "prompt,id\n1,hello\nhi\n", r"shortlast.csv, line 3: the row has 1 field, the header has 2"),
        ("long.csv", "id,prompt\n1,hello\n\n2,hi,extra\n", r"long.csv, line 4: the row has 3 fields, the header has 2"),
        (
            "quoted.csv",
            'id,prompt\n1,"two\nlines"\n2,ok\n3,a,b,c\n4,fine\n',
            r"quoted.csv, line 5: the row has 4 fields, the header has 2; every row needs one value per column",
        ),
        ("p.json", '{"prompt": "x"}\n', r"cannot tell the format from the extension `.json`"),
    ],
)
def test_bad_files(tmp_path, name, content, expected):
    path = write(tmp_path, name, content)
    with pytest.raises(DataError, match=expected) as info:
        load_prompt_records(cfg(path))
    assert name in str(info.value) and "\n" not in str(info.value)


def test_missing_file_and_folder(tmp_path):
    with pytest.raises(DataError, match=r"`.*nope.txt` does not exist"):
        load_prompt_records(cfg(str(tmp_path / "nope.txt")))
    with pytest.raises(DataError, match="is a folder"):  # a folder is a dataset only with format auto / dataset
        load_prompt_records(cfg(str(tmp_path), format="jsonl"))
    with pytest.raises(DataError, match="folder"):  # not a save_to_disk folder (or `datasets` missing)
        load_prompt_records(cfg(str(tmp_path)))


@pytest.mark.parametrize("name", ["p.txt", "p.csv", "p.jsonl", "p.parquet"])
def test_a_fifo_is_refused_without_being_opened(tmp_path, name):
    path = tmp_path / name
    os.mkfifo(path)  # no writer: opening it for reading would block forever
    with pytest.raises(ConfigError, match=r"`data.prompts` = .*: is a FIFO \(named pipe\), not a regular file"):
        check_prompt_file(cfg(str(path)))
    with pytest.raises(ConfigError, match="is a FIFO"):
        load_prompt_records(cfg(str(path)))
    link = tmp_path / ("link-" + name)
    link.symlink_to(path)
    with pytest.raises(ConfigError, match="is a FIFO"):  # followed through a symbolic link
        check_prompt_file(cfg(str(link)))


def test_a_device_is_refused_and_regular_files_and_builtins_pass(tmp_path):
    with pytest.raises(ConfigError, match="is a character device"):
        check_prompt_file(cfg("/dev/zero"))
    check_prompt_file(cfg(write(tmp_path, "ok.txt", "hello\n")))
    check_prompt_file(cfg(str(tmp_path)))  # a folder: a dataset
    check_prompt_file(cfg("builtin:reviews"))
    check_prompt_file(cfg(str(tmp_path / "missing.txt")))  # left to the readers' own message


def test_not_utf8_names_the_byte_offset_and_line(tmp_path):
    path = write(tmp_path, "latin.txt", "caf\xe9 ok\nna\xefve\n".encode("latin-1"), mode="wb")
    with pytest.raises(DataError, match=r"latin.txt` is not UTF-8 text: byte b'\\xe9' at byte offset 3 \(line 1\)"):
        load_prompt_records(cfg(path))


def test_api_list_errors_name_the_item():
    with pytest.raises(DataError, match=r"prompts passed to the API, item 1: the prompt is None"):
        load_prompt_records(cfg(), prompts=["ok", None])
    with pytest.raises(DataError, match="holds no prompts"):
        load_prompt_records(cfg(), prompts=[])
    with pytest.raises(DataError, match="must be a list of records"):
        load_prompt_records(cfg(), prompts="just a string")


# ----------------------------------------------------------------------------- tokenizing


def test_tokenize_each_form(tok):
    msgs = [{"role": "user", "content": "The movie was"}]
    ps = tokenize_prompts(["The movie was", msgs, [5, 6, 7]], tok, cfg())
    assert ps.ids[0] == tok("The movie was")["input_ids"]  # default special tokens: none for this tokenizer
    chat = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ps.ids[1] == list(chat)
    assert ps.texts[1] == "<|im_start|>user\nThe movie was<|im_end|>\n<|im_start|>assistant\n"
    assert ps.ids[2] == [5, 6, 7]
    assert ps.texts == [tok.decode(ids) for ids in ps.ids] and len(ps) == 3


def test_chat_template_flag_wraps_plain_strings(tok):
    ps = tokenize_prompts(["Hi"], tok, cfg(chat_template=True))
    assert ps.texts == ["<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"]


def test_tables_show_each_prompt_as_a_person_wrote_it(tok):
    """`shown`: chat prompts as text, without the template's tokens; what the policy sees stays in `texts`."""
    system = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Review it"}]
    ps = tokenize_prompts(["Hi", [{"role": "user", "content": "The movie was"}], system], tok, cfg(chat_template=True))
    assert ps.shown == ["Hi", "The movie was", "system: Be kind.\nuser: Review it"]
    assert "<|im_start|>" in ps.texts[0] and ps.shown_text(0) == "Hi"
    bos = make_bpe_tokenizer(add_bos=True)
    ids = tokenize_prompts([bos("The movie was")["input_ids"]], bos, cfg())
    assert ids.texts[0].startswith("<|bos|>") and ids.shown == ["The movie was"]  # ids: decoded, no special tokens
    picked = ps.subset([2, 0])
    assert picked.shown == [ps.shown[2], "Hi"] and picked.texts == [ps.texts[2], ps.texts[0]]


def test_bos_tokenizer_keeps_its_bos():
    tok_bos = make_bpe_tokenizer(add_bos=True)
    ps = tokenize_prompts(["The movie was"], tok_bos, cfg())
    assert ps.ids[0][0] == tok_bos.bos_token_id and ps.texts[0] == "<|bos|>The movie was"


def test_truncate_left_warns_once_with_the_count(tok):
    long = "The movie was great and I loved it. " * 3
    ids_long = tok(long)["input_ids"]
    assert len(ids_long) > 8
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ps = tokenize_prompts([long, "short", long], tok, cfg(max_prompt_length=8))
    msgs = [str(w.message) for w in caught]
    assert len(msgs) == 1 and msgs[0].startswith("2 of 3 prompts") and f"has {len(ids_long)}" in msgs[0]
    assert ps.ids[0] == ids_long[-8:] and ps.ids[1] == tok("short")["input_ids"]


def test_truncate_left_keeps_bos():
    tok_bos = make_bpe_tokenizer(add_bos=True)
    ids = tok_bos("The movie was great and I loved it.")["input_ids"]
    with pytest.warns(UserWarning):
        ps = tokenize_prompts(["The movie was great and I loved it."], tok_bos, cfg(max_prompt_length=4))
    assert ps.ids[0] == [tok_bos.bos_token_id] + ids[-3:]


def test_long_prompt_error_names_file_line_and_lengths(tmp_path, tok):
    path = write(tmp_path, "p.txt", "short\n\nThe movie was great and I loved it.\n")
    recs = load_prompt_records(cfg(path))
    n = len(tok("The movie was great and I loved it.")["input_ids"])
    with pytest.raises(
        DataError,
        match=rf"p.txt, line 3: the prompt is {n} tokens, longer than "
        r"data.max_prompt_length = 4",
    ):
        tokenize_prompts(recs, tok, cfg(path, max_prompt_length=4, long_prompts="error"))


def test_token_ids_out_of_vocabulary(tmp_path, tok):
    path = write(tmp_path, "ids.jsonl", '{"prompt": [1, 2]}\n{"prompt": [3, 400]}\n')
    with pytest.raises(
        DataError,
        match=r"ids.jsonl, line 2: token id 400 is outside the tokenizer's vocabulary "
        r"\(ids must be in 0..399\)",
    ):
        tokenize_prompts(load_prompt_records(cfg(path)), tok, cfg(path))
    with pytest.raises(DataError, match=r"prompt 0: token id -1"):
        tokenize_prompts([[-1]], tok, cfg())


def test_no_chat_template(tok):
    plain = make_bpe_tokenizer(chat_template=False)
    with pytest.raises(
        DataError,
        match=r"item 0: the prompt is a list of chat messages, but the tokenizer has no "
        "chat template",
    ):
        tokenize_prompts(load_prompt_records(cfg(), prompts=[[{"role": "user", "content": "x"}]]), plain, cfg())
    with pytest.raises(DataError, match=r"data.chat_template is set, but the tokenizer has no chat template"):
        tokenize_prompts(["x"], plain, cfg(chat_template=True))


def test_unchecked_records_are_checked_by_tokenize(tok):
    with pytest.raises(DataError, match=r"prompt 1: chat message 0 has no `content`"):
        tokenize_prompts(["ok", [{"role": "user"}]], tok, cfg())


# ----------------------------------------------------------------------------- PromptStream


def take(stream, n, **kw):
    return [stream.next_batch(**kw) for _ in range(n)]


def test_stream_is_seeded_and_leaves_the_global_rng_alone():
    import random

    import torch

    torch.manual_seed(123)
    random.seed(123)
    before = (torch.rand(1).item(), random.random())
    torch.manual_seed(123)
    random.seed(123)
    a = take(PromptStream(10, 3, seed=5), 8)
    after = (torch.rand(1).item(), random.random())
    assert before == after
    assert a == take(PromptStream(10, 3, seed=5), 8)
    assert a != take(PromptStream(10, 3, seed=6), 8)


def test_every_pass_draws_every_prompt_once():
    for n, b in [(10, 3), (7, 7), (9, 4), (5, 2)]:
        flat = sum(take(PromptStream(n, b, seed=1), n * 3), [])  # 3 * b full passes
        for p in range(3 * b):
            assert sorted(flat[p * n : (p + 1) * n]) == list(range(n)), (n, b, p)


def test_no_prompt_twice_in_a_batch_across_pass_boundaries():
    for seed in range(20):
        for batch in take(PromptStream(5, 4, seed=seed), 30):
            assert len(set(batch)) == 4


def test_passes_differ_when_shuffled_and_are_in_order_without_shuffle():
    s = PromptStream(20, 20, seed=0)
    assert s.next_batch() != s.next_batch()
    assert take(PromptStream(4, 3, shuffle=False), 2) == [[0, 1, 2], [3, 0, 1]]


def test_more_per_batch_than_prompts():
    batch = PromptStream(3, 7, seed=0).next_batch()
    assert len(batch) == 7 and sorted(set(batch)) == [0, 1, 2]


def test_resume_equals_an_uninterrupted_stream():
    full = take(PromptStream(9, 4, seed=3), 12)
    first = PromptStream(9, 4, seed=3)
    head = take(first, 5)
    state = json.loads(json.dumps(first.state_dict()))  # survives a JSON round trip
    resumed = PromptStream(9, 4, seed=3)
    resumed.load_state_dict(state)
    assert head + take(resumed, 7) == full


def test_resume_with_other_data_is_refused():
    state = PromptStream(9, 4, seed=3).state_dict()
    with pytest.raises(DataError, match="num_prompts = 9, this run has 10"):
        PromptStream(10, 4, seed=3).load_state_dict(state)


def test_rank_slices_are_disjoint_and_make_the_global_batch():
    world = 4
    streams = [PromptStream(10, 8, seed=2) for _ in range(world)]
    reference = PromptStream(10, 8, seed=2)
    for _ in range(10):
        slices = [s.next_batch(rank=r, world_size=world) for r, s in enumerate(streams)]
        assert sum(slices, []) == reference.next_batch()
        assert len(set(sum(slices, []))) == 8
    with pytest.raises(DataError, match="not divisible"):
        PromptStream(10, 6).next_batch(rank=0, world_size=4)
    with pytest.raises(ValueError, match="0 <= rank < world_size"):
        PromptStream(10, 8).next_batch(rank=4, world_size=4)


def test_settled_prompts_are_retired_after_their_streak():
    """`retire_after` 2, 6 prompts in order, 2 a batch: a prompt settled on 2 visits in a row is not drawn again;
    an unsettled visit starts its streak over; the order of the others is the plain stream's."""
    stream = PromptStream(6, 2, shuffle=False, retire_after=2)
    assert stream.next_batch() == [0, 1]
    stream.record_settled([True, True])
    assert stream.next_batch() == [2, 3]
    stream.record_settled([True, False])
    assert stream.next_batch() == [4, 5]
    stream.record_settled([False, False])
    assert stream.next_batch() == [0, 1]  # second pass
    stream.record_settled([True, False])  # 0: 2 in a row (retired); 1: streak back to 0
    assert stream.retired == {0}
    assert stream.next_batch() == [2, 3]
    stream.record_settled([True, True])  # 2: 2 in a row; 3: 1
    assert stream.retired == {0, 2}
    assert stream.settled_streak == {0: 2, 1: 0, 2: 2, 3: 1, 4: 0, 5: 0}
    assert stream.next_batch() == [4, 5]
    assert stream.next_batch() == [1, 3]  # third pass: 0 and 2 skipped
    assert stream.next_batch() == [4, 5]


def test_retiring_keeps_a_batch_of_prompts_and_survives_a_resume():
    stream = PromptStream(4, 2, shuffle=False, retire_after=1)
    for _ in range(4):
        stream.next_batch()
        stream.record_settled([True, True])
    assert len(stream.retired) == 2  # 4 prompts, 2 a batch: one batch of prompts stays in play
    resumed = PromptStream(4, 2, shuffle=False, retire_after=1)
    resumed.load_state_dict(stream.state_dict())
    assert resumed.retired == stream.retired and resumed.settled_streak == stream.settled_streak
    assert take(resumed, 5) == take(stream, 5)
    assert all(p not in stream.retired for batch in take(resumed, 5) for p in batch)


def test_without_retire_after_settled_prompts_stay():
    stream = PromptStream(6, 2, shuffle=False)
    for _ in range(6):
        stream.next_batch()
        stream.record_settled([True, True])
    assert stream.retired == set()
    assert take(stream, 3) == [[0, 1], [2, 3], [4, 5]]


def test_settled_flags_must_match_the_batch():
    stream = PromptStream(6, 2, retire_after=1)
    stream.next_batch()
    with pytest.raises(ValueError, match="3 settled flags for a batch of 2 prompts"):
        stream.record_settled([True, True, False])
