"""A PPOConfig class's fields as JSON-able rows (name, resolved type as a string, default as repr), in order.

Run as a script under an interpreter with TRL 1.12 (the bench venv) it prints TRL's own list, which
tests/data/trl_1_12_ppo_config_fields.json stores for machines without that venv::

    .venv-trl/bin/python tests/trl_fields.py > tests/data/trl_1_12_ppo_config_fields.json
"""

import dataclasses
import json
import typing


def dump(cls) -> list[dict]:
    hints = typing.get_type_hints(cls)
    rows = []
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = None
        rows.append({"name": f.name, "type": str(hints[f.name]), "default": repr(default)})
    return rows


if __name__ == "__main__":
    import transformers
    from trl.experimental.ppo import PPOConfig

    import trl

    print(
        json.dumps(
            {"trl": trl.__version__, "transformers": transformers.__version__, "fields": dump(PPOConfig)}, indent=1
        )
    )
