"""Which generation settings keep sampling honest: `rollout.generation_kwargs` checked against the settings that
bend the sampled distribution (refused unless `rollout.allow_distorting_sampling`). A leaf module, so that
`Config.validate()` refuses them before anything is loaded; `lmppo.sampling.hf` applies them."""

from __future__ import annotations

from lmppo.errors import ConfigError

# Generation settings that make the sampled distribution differ from softmax(logits / T), with their
# neutral value. With any of them the policy's logprob of a sampled token is not the probability it was
# sampled with, so the KL estimate is biased (often negative, see the PPO training tips) and the ratio is off.
DISTORTING_SETTINGS: dict[str, object] = {
    "top_k": 0,
    "top_p": 1.0,
    "min_p": None,
    "top_h": None,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "min_length": 0,
    "min_new_tokens": None,
    "repetition_penalty": 1.0,
    "encoder_repetition_penalty": 1.0,
    "length_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0,
    "bad_words_ids": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "sequence_bias": None,
    "num_beams": 1,
    "num_beam_groups": 1,
    "diversity_penalty": 0.0,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "exponential_decay_length_penalty": None,
    "guidance_scale": None,
    "watermarking_config": None,
    "renormalize_logits": False,
}
WHY_DISTORTING = (
    "it changes the distribution tokens are sampled from, so the logprobs lmppo computes (pure softmax at the "
    "temperature) are not the sampling probabilities: the KL penalty is mis-measured, typically driven negative "
    "(e.g. min_new_tokens forbids the stop token, top_k/top_p cut the tail), and the policy learns to exploit it "
    "instead of the reward. Use pure sampling (adjust `rollout.temperature`), or set "
    "rollout.allow_distorting_sampling: true to accept the bias knowingly"
)
ALLOWED_SETTINGS = {"use_cache", "cache_implementation", "output_scores", "return_dict_in_generate"}


def check_generation_kwargs(kwargs: dict, allow_distorting: bool) -> list[str]:
    """Raise ConfigError for unknown or distorting settings (unless allowed); return the distorting ones used."""
    distorting = []
    for key, value in kwargs.items():
        if key in ("do_sample", "temperature", "max_new_tokens", "eos_token_id", "pad_token_id"):
            raise ConfigError(
                f"rollout.generation_kwargs.{key}",
                value,
                "is set by lmppo itself; use the rollout fields (temperature, max_new_tokens, stop_token)",
            )
        if key in DISTORTING_SETTINGS:
            if value != DISTORTING_SETTINGS[key]:
                distorting.append(key)
        elif key not in ALLOWED_SETTINGS:
            raise ConfigError(
                f"rollout.generation_kwargs.{key}",
                value,
                "is not a generation setting lmppo knows; allowed: "
                + ", ".join(sorted(ALLOWED_SETTINGS | set(DISTORTING_SETTINGS))),
            )
    if distorting and not allow_distorting:
        raise ConfigError(
            "rollout.generation_kwargs", {k: kwargs[k] for k in distorting}, "is refused: " + WHY_DISTORTING
        )
    return distorting
