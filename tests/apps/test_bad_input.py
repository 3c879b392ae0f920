"""Mistakes a user can make get one clear line on stderr and exit code 2 from `lmppo train`, no traceback; and
random configs and prompt files fail only with lmppo's own errors, before any model is loaded."""

from __future__ import annotations

import os
import string
import tempfile

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cli_support import REWARDS, assert_one_clean_line, changed, env, run_cli, slow_server, write  # noqa: F401  (fixtures)
from lmppo.apps.cli import main
from lmppo.config import DataConfig, all_fields, load_config
from lmppo.data.prompts import load_prompt_records, tokenize_prompts
from lmppo.errors import LmppoError
from lmppo.sampling.hf import check_generation_kwargs

# ----------------------------------------------------------------------------- the config file

CONFIG_CASES = {
    # name: (YAML text or a function of (tmp_path, base) giving the config dict, what the message must name)
    "malformed YAML": ("rollout: [1, 2\nppo: 3\n", ["not valid YAML", "line 2", "bad.yaml"]),
    "unknown key": ({"totl_episodes": 5}, ["`totl_episodes`", "did you mean `total_episodes`"]),
    "unknown nested key": ({"ppo": {"learning_rat": 1}}, ["`ppo.learning_rat`", "ppo.learning_rate"]),
    "wrong type": ({"ppo": {"num_epochs": "many"}}, ["`ppo.num_epochs`", "'many'", "integer"]),
    "wrong type, fraction": ({"rollout": {"batch_size": 1.5}}, ["`rollout.batch_size`", "1.5", "integer"]),
    "section not a mapping": ({"ppo": 5}, ["`ppo`", "mapping"]),
    "code in YAML": ("seed: !!python/object/apply:os.system [ls]\n", ["not valid YAML", "python/object"]),
    "not UTF-8": (b"seed: \xff\n", ["not UTF-8", "bad.yaml"]),
    "top level is a list": ("- 1\n- 2\n", ["mapping", "bad.yaml"]),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_bad_config_file(env, capsys, case):
    tmp_path, _base = env
    content, names = CONFIG_CASES[case]
    path = (
        write(tmp_path, "bad.yaml", text=content)
        if isinstance(content, (str, bytes))
        else write(tmp_path, "bad.yaml", data=content)
    )
    assert_one_clean_line(*run_cli(["train", path], capsys), *names)


def _bad_json_file(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"prompt": "fine"}\n{"prompt": \n')
    return str(tmp_path / "bad.jsonl")


def _undecodable(tmp_path):
    (tmp_path / "bytes.txt").write_bytes(b"the movie was\n\xff\xfe broken\n")
    return str(tmp_path / "bytes.txt")


def _empty(tmp_path):
    (tmp_path / "empty.txt").write_text("\n   \n")
    return str(tmp_path / "empty.txt")


RUN_CASES = {
    # name: (dotted changes of the base config (values may be functions of tmp_path), what the message names)
    "impossible minibatch split": (
        dict(total_episodes=16, rollout__batch_size=16, ppo__num_minibatches=3),
        ["`ppo.num_minibatches`", "must divide rollout.batch_size (16)"],
    ),
    "impossible micro-batch split": (
        dict(total_episodes=16, rollout__batch_size=16, ppo__num_minibatches=2, ppo__micro_batch_size=3),
        ["`ppo.micro_batch_size`", "minibatch size (8"],
    ),
    "fewer episodes than a batch": (dict(total_episodes=2), ["`total_episodes`", "rollout.batch_size (4)"]),
    "missing prompt file": (dict(data__prompts=lambda t: str(t / "nope.txt")), ["`data.prompts`", "nope.txt"]),
    "missing model folder": (dict(model__policy=lambda t: str(t / "no_model")), ["`model.policy`", "no_model"]),
    "missing reward file": (
        dict(reward__sources=lambda t: [{"kind": "function", "path": f"{t / 'nofile.py'}:f"}]),
        ["nofile.py", "no such file"],
    ),
    "empty prompt file": (dict(data__prompts=_empty), ["empty.txt", "empty"]),
    "undecodable prompt file": (dict(data__prompts=_undecodable), ["bytes.txt", "not UTF-8", "line 2"]),
    "bad JSON line": (dict(data__prompts=_bad_json_file), ["bad.jsonl, line 2", "not valid JSON"]),
    "prompt + response longer than the model": (
        dict(data__max_prompt_length=250, rollout__max_new_tokens=24),
        ["`data.max_prompt_length`", "rollout.max_new_tokens", "256"],
    ),
    "stop token not in the vocabulary": (dict(rollout__stop_token="zzqqzzqq"), ["`rollout.stop_token`"]),
    "reward function raises": (
        dict(reward__sources=lambda t: [{"kind": "function", "path": f"{t / 'rewards.py'}:raises"}]),
        ["reward source `raises`", "ValueError: the scorer crashed"],
    ),
    "reward function returns a string": (
        dict(reward__sources=lambda t: [{"kind": "function", "path": f"{t / 'rewards.py'}:text"}]),
        ["reward source `text`", "'garbage'", "expected a list of 4"],
    ),
    "reward function returns too few": (
        dict(reward__sources=lambda t: [{"kind": "function", "path": f"{t / 'rewards.py'}:short"}]),
        ["reward source `short`", "1 outputs"],
    ),
    "reward function returns NaN": (
        dict(reward__sources=lambda t: [{"kind": "function", "path": f"{t / 'rewards.py'}:nan"}]),
        ["reward source `nan`", "sample 0", "nan"],
    ),
}


@pytest.mark.parametrize("case", list(RUN_CASES))
def test_bad_run_setting(env, capsys, case):
    tmp_path, base = env
    changes, names = RUN_CASES[case]
    changes = {k: v(tmp_path) if callable(v) else v for k, v in changes.items()}
    path = write(tmp_path, "config.yaml", data=changed(base, **changes))
    assert_one_clean_line(*run_cli(["train", path], capsys), *names)


def test_http_reward_that_times_out(env, capsys, slow_server):
    tmp_path, base = env
    url = f"http://user:pa55word@127.0.0.1:{slow_server}/score"
    cfg = changed(base, reward__sources=[{"kind": "http", "path": url, "timeout": 0.2, "retries": 0}])
    code, err = run_cli(["train", write(tmp_path, "config.yaml", data=cfg)], capsys)
    assert_one_clean_line(code, err, "timeout", f"http://***@127.0.0.1:{slow_server}/score", "0.2 s")
    assert "pa55word" not in err


def test_command_line_mistakes(env, capsys):
    tmp_path, base = env
    cases = [
        (["train", "--ppo.learnin_rate", "1"], ["--ppo.learnin_rate", "did you mean `--ppo.learning_rate`"]),
        (["train", "--ppo.num_epochs", "abc"], ["`ppo.num_epochs`", "'abc'"]),
        (["train", "--ppo.num_epochs"], ["--ppo.num_epochs", "needs a value"]),
        (["train", str(tmp_path / "nope.yaml")], ["config file", "nope.yaml", "no such file"]),
        (["train", "builtin:nope"], ["config file", "builtin:nope", "builtin:arithmetic", "builtin:learned_reward"]),
        (["train", "--resume"], ["--resume", "needs"]),
        (["train", "--resume", str(tmp_path / "nothing")], ["nothing", "no such folder"]),
        (["trian"], ["unknown command 'trian'", "did you mean `train`"]),
    ]
    for argv, names in cases:
        assert_one_clean_line(*run_cli(argv, capsys), *names)


def test_existing_run_is_refused_then_overwritten_on_request(env, capsys):
    tmp_path, base = env
    path = write(tmp_path, "config.yaml", data=base)
    assert run_cli(["train", path], capsys)[0] == 0
    assert_one_clean_line(
        *run_cli(["train", path], capsys), "`output_dir`", "already holds a run", "--resume", "overwrite: true"
    )
    assert run_cli(["train", path, "--overwrite", "true"], capsys)[0] == 0


def test_debug_shows_the_traceback(env):
    tmp_path, base = env
    with pytest.raises(LmppoError):
        main(["train", "--debug", "--ppo.num_epochs", "abc"])


def test_override_with_broken_yaml_is_a_clean_error(capsys):
    assert_one_clean_line(*run_cli(["train", "--rollout.generation_kwargs", "{a"], capsys), "rollout.generation_kwargs")


def test_seed_out_of_range_is_a_config_error():
    with pytest.raises(LmppoError, match="seed"):  # refused as the override is applied
        load_config(None, {"seed": "-1"}).validate()


def test_csv_field_over_the_csv_module_limit_is_a_data_error(tmp_path):
    (tmp_path / "big.csv").write_text('prompt\n"' + "a" * 200_000 + '"\n')
    with pytest.raises(LmppoError, match="big.csv"):
        load_prompt_records(DataConfig(prompts=str(tmp_path / "big.csv")))


def test_deeply_nested_json_line_is_a_data_error(tmp_path):
    (tmp_path / "deep.jsonl").write_text('{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    with pytest.raises(LmppoError, match="deep.jsonl, line 1"):
        load_prompt_records(DataConfig(prompts=str(tmp_path / "deep.jsonl")))


# ----------------------------------------------------------------------------- property-based

FAKE_KEYS = ["totl_episodes", "lr", "ppo.learning_rate", "", "__class__", "Seed", "model.policy", "sources"]
GARBAGE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**20), max_value=10**20),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.lists(st.integers(-3, 3), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)


def _value_for(tp, default):
    name = getattr(tp, "__name__", str(tp))
    typed = {
        "int": st.integers(-3, 40),
        "float": st.floats(-2.0, 10.0) | st.sampled_from([0.0, float("nan"), 1e30]),
        "bool": st.booleans(),
        "str": st.sampled_from(
            [
                "",
                "auto",
                "none",
                "eos",
                "bogus",
                "hf",
                "k3",
                "adaptive",
                "shared",
                "critic",
                "builtin:reviews",
                "linear",
            ]
        ),
    }.get(name)
    options = [st.just(default), GARBAGE] + ([typed] if typed is not None else [])
    return st.one_of(*options)


def _plain(value):
    """A default as YAML can write it (lists of config sections as mappings)."""
    import dataclasses

    if isinstance(value, list):
        return [dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for v in value]
    return value


FIELDS = [(name, tp, _plain(default)) for name, tp, default, _doc in all_fields()]


@st.composite
def config_mappings(draw):
    """A YAML mapping: some real fields (valid, out-of-range or wrongly typed values), maybe fake keys."""
    data: dict = {}
    chosen = draw(st.lists(st.sampled_from(FIELDS), max_size=8, unique_by=lambda f: f[0]))
    for name, tp, default in chosen:
        obj = data
        *parents, leaf = name.split(".")
        for p in parents:
            obj = obj.setdefault(p, {}) if isinstance(obj.get(p, {}), dict) else obj
        obj[leaf] = draw(_value_for(tp, default))
    for key in draw(st.lists(st.sampled_from(FAKE_KEYS), max_size=2)):
        data[key] = draw(GARBAGE)
    if draw(st.booleans()):
        data.setdefault("reward", {})["sources"] = draw(
            st.lists(
                st.one_of(
                    st.fixed_dictionaries(
                        {
                            "kind": st.sampled_from(["function", "http", "model", "rpc"]),
                            "path": st.sampled_from(["", "m:f", "http://x", "ftp://u:p@h", "/nowhere"]),
                            "timeout": st.floats(-1, 5),
                        }
                    ),
                    GARBAGE,
                ),
                max_size=2,
            )
        )
    return data


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=config_mappings(),
    mangle=st.one_of(
        st.none(),
        st.tuples(
            st.integers(0, 400),
            st.sampled_from(["", ":", "[", "{", "\t", "- ", "\n  x", "\x00", "'", "!!python/name:os.system"]),
        ),
    ),
)
def test_random_configs_fail_only_with_lmppo_errors(data, mangle):
    text = yaml.safe_dump(data, allow_unicode=True)
    if mangle is not None:
        at, insert = mangle
        text = text[:at] + insert + text[at:]
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "config.yaml")
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text)
        try:
            cfg = load_config(path)
            cfg.validate()
            check_generation_kwargs(cfg.rollout.generation_kwargs, cfg.rollout.allow_distorting_sampling)
        except LmppoError as err:
            assert str(err) and "\n" not in str(err).strip() or "YAML" in str(err), str(err)


JSON_LINES = st.sampled_from(
    [
        '{"prompt": "the movie was"}',
        '{"prompt": [1, 2, 3]}',
        '{"prompt": [{"role": "user", "content": "hi"}]}',
        '{"prompt": ',
        '{"text": "x"}',
        "[1, 2]",
        '"just a string"',
        '{"prompt": null}',
        '{"prompt": [1, "a"]}',
        '{"prompt": [-1, 99999]}',
        '{"prompt": ""}',
        '{"prompt": [{"role": 1}]}',
        '{"prompt": NaN}',
        "",
        "   ",
        '{"prompt": [{"role": "user", "content": 5}]}',
        '{"prompt": []}',
        '{"prompt": {"a": 1}}',
    ]
)


@st.composite
def prompt_files(draw):
    kind = draw(st.sampled_from(["bytes", "jsonl", "text", "csv", "empty"]))
    if kind == "bytes":
        content = draw(st.binary(max_size=120))
    elif kind == "jsonl":
        content = "\n".join(draw(st.lists(JSON_LINES, max_size=6))).encode()
    elif kind == "csv":
        rows = draw(st.lists(st.lists(st.text(string.printable, max_size=8), min_size=1, max_size=3), max_size=4))
        content = "\n".join(",".join(r) for r in [["prompt", "x"]] + rows).encode()
    elif kind == "text":
        content = draw(st.text(max_size=80)).encode("utf-8", "surrogatepass")
    else:
        content = b""
    ext = draw(st.sampled_from([".jsonl", ".csv", ".txt", ".json", ""]))
    fmt = draw(st.sampled_from(["auto", "jsonl", "csv", "text", "xml"]))
    field = draw(st.sampled_from(["prompt", "text", ""]))
    return (
        content,
        ext,
        dict(
            format=fmt,
            field=field,
            max_prompt_length=draw(st.integers(-1, 12)),
            long_prompts=draw(st.sampled_from(["truncate_left", "error", "bogus"])),
            chat_template=draw(st.booleans()),
        ),
    )


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=prompt_files())
def test_random_prompt_files_fail_only_with_lmppo_errors(tokenizer, spec):
    content, ext, fields = spec
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "prompts" + ext)
        with open(path, "wb") as fh:
            fh.write(content)
        try:
            data_cfg = DataConfig(prompts=path, **fields)  # a bad choice is refused here, as a ConfigError
            records = load_prompt_records(data_cfg)
            prompt_set = tokenize_prompts(records, tokenizer, data_cfg)
        except LmppoError as err:
            assert str(err), type(err)
        else:
            assert len(prompt_set) == len(records) > 0
            assert all(0 < len(ids) <= data_cfg.max_prompt_length for ids in prompt_set.ids)
