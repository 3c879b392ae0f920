"""lmppo.evaluation.arguments: `lmppo eval`'s command line, parsed apart from the command (no torch needed)."""

from __future__ import annotations

import pytest

from lmppo.evaluation.arguments import eval_parser


def test_eval_arguments_defaults_and_overrides_left_for_the_config():
    args, rest = eval_parser().parse_known_args(["runs/a", "--num-prompts", "8", "--rollout.temperature", "1.0"])
    assert (args.model, args.num_prompts, args.samples_per_prompt, args.show, args.seed) == ("runs/a", 8, 4, 3, None)
    assert rest == ["--rollout.temperature", "1.0"]  # a config override, read by the command
    with pytest.raises(SystemExit) as bad:
        eval_parser().parse_known_args(["runs/a", "--samples-per-prompt", "many"])
    assert bad.value.code == 2
