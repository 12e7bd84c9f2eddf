"""Prompt formats (spec.data.promptFormat): chat messages through the policy tokenizer's chat template, or text.

A templated prompt already holds the model's special tokens (BOS, role markers), so the rollout tokenizes it
without adding any: the ids are those of `apply_chat_template(..., tokenize=True)`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from hybridflow.api.spec import PromptFormat
from hybridflow.data import DataError

FORMAT_KEY = "format"
"""Row key set to CHAT on a prompt the chat template rendered; a row without it is plain text."""
CHAT = "chat"

Message = dict[str, Any]


class ChatTemplateError(DataError):
    """No chat template to render chat prompts with, or one that refuses them; names spec.data.promptFormat."""


def is_messages(value: object) -> bool:
    """A list of {role, content} dicts: the chat-style prompt of HF datasets and the OpenAI API."""
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and "role" in m and "content" in m for m in value)


def as_messages(value: object, prompt_format: PromptFormat) -> list[Message] | None:
    """The messages a prompt is rendered from, or None when it is used as text.

    auto: message lists only; chat: message lists, and anything else as the content of one user message;
    raw: never.
    """
    if prompt_format == "raw":
        return None
    if is_messages(value):
        assert isinstance(value, list)
        return [dict(m) for m in value]
    if prompt_format == "chat":
        return [{"role": "user", "content": join_text(value)}]
    return None


def join_text(value: object) -> str:
    """A prompt as plain text: the contents of a message list joined by newlines; a string as it is."""
    if isinstance(value, list):
        return "\n".join(str(m.get("content", "")) if isinstance(m, dict) else str(m) for m in value)
    return str(value)


@functools.cache
def policy_tokenizer(path: str) -> Any:
    """The tokenizer of spec.model.policy.path, loaded once per process: the chat template and the count of each
    prompt's tokens (data.prompts) read the same one, for train and val."""
    from transformers import AutoTokenizer

    from hybridflow.hub import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path(path, "spec.model.policy.path"))


class ChatTemplate:
    """`apply_chat_template(messages, add_generation_prompt=True, tokenize=False)` of a tokenizer."""

    def __init__(self, tokenizer: Any, source: str) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ChatTemplateError(
                f"spec.data.promptFormat: chat prompts need a chat template, and the tokenizer of "
                f"spec.model.policy.path ({source}) has none; use promptFormat raw (the messages' contents joined "
                f"by newlines) or a model whose tokenizer_config.json has a chat_template")
        self.tokenizer, self.source = tokenizer, source

    @classmethod
    def of_model(cls, path: str) -> ChatTemplate:
        """The template of the tokenizer in model directory `path` (`builtin:tiny` resolves to its directory)."""
        try:
            tokenizer = policy_tokenizer(path)
        except (OSError, ValueError) as e:  # HubError is a ValueError
            raise ChatTemplateError(f"spec.data.promptFormat: chat prompts need the tokenizer of "
                                    f"spec.model.policy.path, which cannot be loaded from {path!r}: {e}") from None
        return cls(tokenizer, path)

    def render(self, messages: list[Message]) -> str:
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # a template may raise on messages it does not take (jinja2 TemplateError, ...)
            raise ChatTemplateError(f"spec.data.promptFormat: the chat template of {self.source} refused the "
                                    f"messages {messages!r}: {e}") from None
        return str(text)


class PromptRenderer:
    """One prompt value -> the row fields of its text; the template is loaded on the first chat prompt only."""

    def __init__(self, prompt_format: PromptFormat, template: Callable[[], ChatTemplate] | None = None) -> None:
        self.prompt_format = prompt_format
        self._load = template
        self._template: ChatTemplate | None = None

    def __call__(self, value: object) -> dict[str, str]:
        messages = as_messages(value, self.prompt_format)
        if messages is None:
            return {"prompt": join_text(value)}
        return {"prompt": self.template().render(messages), FORMAT_KEY: CHAT}

    def template(self) -> ChatTemplate:
        if self._template is None:
            if self._load is None:
                raise ChatTemplateError("spec.data.promptFormat: chat prompts need the policy tokenizer's chat "
                                        "template, and none was given")
            self._template = self._load()
        return self._template


MIDDLE = "middle"
"""spec.data.truncation middle as the tokenizer's truncation_side, which the tokenizer itself cuts only left or right:
prompt_token_ids cuts it."""


def prompt_token_ids(tokenizer: Any, rows: list[dict[str, str]], max_length: int | None = None) -> list[list[int]]:
    """Each row's prompt ids, at most `max_length` of them, cut on the tokenizer's truncation_side: `left` and
    `right` by the tokenizer, which keeps its special tokens; `middle` (MIDDLE) keeps the first max_length // 2 ids
    and the rest from the end, as verl cuts.

    A prompt the chat template rendered already holds its special tokens, so it is tokenized without the
    tokenizer's own (no second BOS): its ids are apply_chat_template's. Plain prompts get them as always.
    Each distinct prompt is tokenized once: a group of samples repeats its prompt.
    """
    chat = [r.get(FORMAT_KEY) == CHAT for r in rows]
    ids: list[list[int]] = [[] for _ in rows]
    for templated in (False, True):
        where = [i for i, c in enumerate(chat) if c == templated]
        if where:
            distinct = list(dict.fromkeys(rows[i]["prompt"] for i in where))
            middle = max_length is not None and getattr(tokenizer, "truncation_side", None) == MIDDLE
            cut = max_length is not None and not middle
            enc = tokenizer(distinct, add_special_tokens=not templated, truncation=cut, max_length=max_length)
            by_prompt = dict(zip(distinct, enc["input_ids"], strict=True))
            if middle:
                assert max_length is not None
                by_prompt = {p: cut_middle(x, max_length) for p, x in by_prompt.items()}
            for i in where:
                ids[i] = list(by_prompt[rows[i]["prompt"]])
    return ids


def cut_middle(ids: list[int], max_length: int) -> list[int]:
    """ids[:h] + ids[-(max_length - h):], h = max_length // 2; ids as they are when they fit."""
    if len(ids) <= max_length:
        return ids
    head = max_length // 2
    return ids[:head] + ids[len(ids) - (max_length - head):]
