"""Reward sources (Python function, reward model, HTTP service) and placing their outputs on tokens.

``build_reward_sources(cfg.reward, functions)`` builds the sources; ``score_rollout(...)`` calls them on a
rollout batch and returns the weighted per-token scores, which samples are valid, and each source's totals.
Importing this package registers the built-in kinds (`function`, `model`, `http`).
"""

from lmppo.rewards.building import build_reward_sources, run_source_context  # noqa: F401,E402
from lmppo.rewards.functions import FunctionSource, check_source_arguments, import_callable  # noqa: F401,E402
from lmppo.rewards.http import HttpSource  # noqa: F401,E402
from lmppo.rewards.model import ModelSource  # noqa: F401,E402
from lmppo.rewards.placement import (  # noqa: F401,E402
    decode_completion,
    parse_output,
    place_scores,
    token_char_offsets,
)
from lmppo.rewards.scoring import RewardResult, score_rollout  # noqa: F401,E402
from lmppo.rewards.sources import (  # noqa: F401
    REWARD_SOURCES,
    RewardSource,
    SourceContext,
    mask_url,
    register_reward_source,
)

__all__ = [
    "REWARD_SOURCES",
    "FunctionSource",
    "HttpSource",
    "ModelSource",
    "RewardResult",
    "RewardSource",
    "SourceContext",
    "build_reward_sources",
    "run_source_context",
    "check_source_arguments",
    "decode_completion",
    "import_callable",
    "mask_url",
    "parse_output",
    "place_scores",
    "register_reward_source",
    "score_rollout",
    "token_char_offsets",
]
