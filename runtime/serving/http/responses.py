"""OpenAI response bodies and stream chunks for completions and chat completions.

Besides OpenAI's fields, every choice carries `token_ids`: the generated token ids (on a
stream, those of this chunk). A package without a tokenizer answers token-id prompts
with text "" and the ids there.
"""

from __future__ import annotations

import json
import time


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class Shaper:
    """Builds one request's bodies: the same id, creation time and model in each."""

    def __init__(self, request_id: str, model: str, chat: bool):
        self.id, self.model, self.chat = request_id, model, chat
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def response(self, text: str, token_ids: list[int], finish_reason: str, use: dict) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason,
                      "logprobs": None, "token_ids": token_ids}
            return self._head("chat.completion") | {"choices": [choice], "usage": use}
        choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None, "token_ids": token_ids}
        return self._head("text_completion") | {"choices": [choice], "usage": use}

    def chunk(self, text: str, token_ids: list[int], finish_reason: str | None = None, role: bool = False) -> dict:
        if self.chat:
            delta = ({"role": "assistant"} if role else {}) | {"content": text}
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None,
                      "token_ids": token_ids}
            return self._head("chat.completion.chunk") | {"choices": [choice]}
        choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None, "token_ids": token_ids}
        return self._head("text_completion") | {"choices": [choice]}

    def usage_chunk(self, use: dict) -> dict:
        return self._head("chat.completion.chunk" if self.chat else "text_completion") | {"choices": [], "usage": use}


def sse(data: dict | str) -> str:
    """One server-sent event: `data: JSON` (or the literal [DONE])."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n"
