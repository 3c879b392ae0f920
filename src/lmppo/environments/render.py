"""Observations as tokens: token in, token out.

An episode is one growing id list. The policy's tokens are kept exactly as sampled; only each *new* observation is
encoded and appended, never the history (re-rendering the history can change earlier tokens: templates that drop
past reasoning, text that re-encodes differently). For chat rendering the new messages' ids are the difference of
two renderings of a fixed dummy conversation, with and without them:

    base = template([user "U", assistant "A"])                      ... A <|im_end|> \\n
    full = template([user "U", assistant "A", *new], generation prompt)
    observation ids = (base after its last end-of-turn token) + full[len(base):]

so the glue after the end-of-turn token the policy sampled (SmolLM2's "\\n" before the next <|im_start|>, which a
message rendered alone would lose) is part of the observation. `ChatObservations` checks once that the template
is prefix-preserving (full starts with base) and fails with one line otherwise.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Iterable, Mapping, Optional, Sequence

from lmppo.environments.api import EnvironmentError, Messages
from lmppo.environments.tools import JsonObject, template_renders_tools, with_tool_prompt

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_DUMMY: Messages = [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]


def _ids(out: object) -> list[int]:
    if isinstance(out, Mapping):  # a dict or a BatchEncoding (a mapping) on some versions
        out = out["input_ids"]
    if not isinstance(out, Iterable):
        raise TypeError(f"the tokenizer gave {type(out).__name__}, not token ids")
    return [int(t) for t in out]


class Observations:
    """Plain text: the opening and each observation encoded as they are (message contents joined by newlines)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop_ids: Sequence[int]):
        self.tokenizer, self.stop_ids = tokenizer, list(stop_ids)

    def opening(self, messages: Messages, tools: Optional[list[JsonObject]] = None) -> list[int]:
        if tools:
            messages = with_tool_prompt(messages, tools)
        return _ids(self.tokenizer("\n".join(m["content"] for m in messages))["input_ids"])

    def observation(self, messages: Messages, turn_ended: bool) -> list[int]:
        """The ids to append after a policy turn (`turn_ended`: it ended on the stop token)."""
        text = "\n" + "\n".join(m["content"] for m in messages) + "\n"
        return _ids(self.tokenizer(text, add_special_tokens=False)["input_ids"])


class ChatObservations(Observations):
    """Chat messages through the tokenizer's chat template; tools through the template when it renders `tools`,
    else in a plain system message (`lmppo.environments.tools.plain_tool_prompt`)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop_ids: Sequence[int]):
        super().__init__(tokenizer, stop_ids)
        if not getattr(tokenizer, "chat_template", None):
            raise EnvironmentError(
                "environment.render `chat`: the tokenizer has no chat template (use environment.render `text`)"
            )
        self.native_tools = template_renders_tools(tokenizer.chat_template)
        base = self._render(_DUMMY, generation=False)
        ends = [i for i, t in enumerate(base) if t in self.stop_ids]
        if not ends:
            closing = turn_end_token(tokenizer)
            raise EnvironmentError(
                "environment.render `chat`: the chat template does not end an assistant turn with the stop token "
                f"(rollout.stop_token, ids {self.stop_ids}); observations cannot be appended after a turn"
                + (f": set rollout.stop_token to `{closing}`, the token it ends one with" if closing else "")
            )
        self.base, self.glue = base, base[ends[-1] + 1 :]  # glue: what the template puts after the end-of-turn token
        probe = self._render([*_DUMMY, {"role": "user", "content": "U"}], generation=True)
        if probe[: len(base)] != base:
            raise EnvironmentError(
                "environment.render `chat`: the chat template is not prefix-preserving (rendering one more message "
                "changes the tokens of the earlier ones), so observations cannot be appended token by token"
            )

    def _render(self, messages: Messages, generation: bool, tools: Optional[list[JsonObject]] = None) -> list[int]:
        render = partial(
            self.tokenizer.apply_chat_template,
            messages,
            add_generation_prompt=generation,
            tokenize=True,
            return_dict=False,
        )
        return _ids(render(tools=[*tools]) if tools else render())

    def opening(self, messages: Messages, tools: Optional[list[JsonObject]] = None) -> list[int]:
        if tools and not self.native_tools:
            messages, tools = with_tool_prompt(messages, tools), None
        return self._render(messages, generation=True, tools=tools)

    def observation(self, messages: Messages, turn_ended: bool) -> list[int]:
        full = self._render([*_DUMMY, *messages], generation=True)
        if full[: len(self.base)] != self.base:
            raise EnvironmentError(
                "environment.render `chat`: the chat template is not prefix-preserving for the observation "
                f"{messages!r:.80}"
            )
        closing = [] if turn_ended else [self.stop_ids[0]]  # a turn cut at max_new_tokens is closed as context
        return closing + self.glue + full[len(self.base) :]


def turn_end_token(tokenizer: PreTrainedTokenizerBase) -> Optional[str]:
    """The special token the chat template closes an assistant turn with (`<|im_end|>` for SmolLM2), if any: the
    first special token after the assistant's content in a rendered dummy conversation."""
    text = str(tokenizer.apply_chat_template(_DUMMY, tokenize=False))
    after = text[text.rindex(_DUMMY[-1]["content"]) + 1 :]
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    ids = _ids(tokenizer(after, add_special_tokens=False)["input_ids"])
    return next((str(tokenizer.convert_ids_to_tokens(i)) for i in ids if i in special), None)


def observation_encoder(tokenizer: PreTrainedTokenizerBase, stop_ids: Sequence[int], render: str) -> Observations:
    """The encoder of `environment.render` (`auto`: chat when the tokenizer has a chat template)."""
    chat = render == "chat" or (render == "auto" and bool(getattr(tokenizer, "chat_template", None)))
    if chat and not stop_ids:
        raise EnvironmentError("environment.render `chat` needs a stop token (rollout.stop_token is `none`)")
    return ChatObservations(tokenizer, stop_ids) if chat else Observations(tokenizer, stop_ids)
