"""`lmppo train --help` generated from the schema (lmppo.config.help); the command: tests/apps/test_cli_help.py."""

from typing import Literal

from lmppo.config.help import show, train_help, type_name


def test_defaults_are_shown_as_yaml():
    assert [show(v) for v in (True, False, None, "", "runs/x", " pad", 0.5, 1e-6)] == [
        "true",
        "false",
        "null",
        '""',
        "runs/x",
        '" pad"',
        "0.5",
        "1e-06",
    ]
    assert show({"a": [1, "b"], "c": None}) == "{a: [1, b], c: null}"


def test_type_names_show_choices_and_lists():
    assert type_name(Literal["last", "spread"]) == "{last,spread}"
    assert type_name(list[str]) == "LIST[STR]"
    assert type_name(int) == "INT"


def test_train_help_documents_the_nested_reward_sources():
    text = train_help()
    for expected in ("--reward.sources", "kind {", "span_placement {last,spread}", "timeout FLOAT", "fields by kind"):
        assert expected in text, expected
    assert "RewardSourceConfig(" not in text  # no Python reprs
