"""Prompts to token ids, as vLLM makes them, so the gateway admits the tokens the engine will
hold and its prefix hashes match the engine's.

- Chat: the model's chat template renders the messages (with the request's template arguments),
  and the text is tokenized without adding special tokens: the template wrote them.
- Completions: a text is tokenized with the tokenizer's special tokens (vLLM's default); token
  ids are taken as they are.

The tokenizer is the model's own, loaded with `transformers` from a directory or a hub id (the
gateway's machine needs its files: set HF_HUB_OFFLINE=1 where it must not download them).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

from kvquota.gateways.openai_requests import BadLlmRequest, LlmRequest


def _text_content(message: Mapping[str, Any]) -> dict[str, Any]:
    """A message whose content is text: vLLM joins a list of text parts with newlines for a
    template that takes strings."""
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                raise BadLlmRequest("only text content is admitted through kvquota")
            texts.append(str(part.get("text", "")))
        return {**message, "content": "\n".join(texts)}
    return dict(message)


class PromptTokenizer:
    """One model's tokenizer, loaded on first use."""

    def __init__(self, source: str) -> None:
        self.source = source
        self._tokenizer: Any = None
        self._loading = threading.Lock()

    def _loaded(self) -> Any:
        with self._loading:
            if self._tokenizer is None:
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(self.source)
            return self._tokenizer

    def prompt_token_ids(self, request: LlmRequest) -> list[int]:
        tokenizer = self._loaded()
        if request.messages is not None:
            messages = [_text_content(m) for m in request.messages]
            try:
                text = tokenizer.apply_chat_template(
                    messages, tokenize=False, **request.chat_template_kwargs
                )
            except Exception as exc:  # the template's own error (a jinja raise_exception, ...)
                raise BadLlmRequest(f"the chat template refused the messages: {exc}") from None
            return list(tokenizer.encode(text, add_special_tokens=False))
        prompt: str | Sequence[int] | None = request.prompt
        if isinstance(prompt, str):
            return list(tokenizer.encode(prompt))
        return list(prompt or ())
