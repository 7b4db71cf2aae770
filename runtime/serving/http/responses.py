"""OpenAI response bodies and stream chunks for completions and chat completions.

Besides OpenAI's fields, every choice carries `token_ids`: the generated token ids (on a
stream, those of this chunk). A package without a tokenizer answers with text "" and the
ids there.
"""

from __future__ import annotations

import json
import time

from b12x_toolchain.runtime.serving.http.choices import Delta


class Shaper:
    """Builds one request's bodies: the same id, creation time and model in each."""

    def __init__(self, request_id: str, model: str, chat: bool):
        self.id, self.model, self.chat = request_id, model, chat
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def response(self, choices: list[Delta], use: dict) -> dict:
        """The whole answer: `choices` hold each choice's text, ids and logprobs, joined."""
        if self.chat:
            body = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                     "finish_reason": c.finish_reason, "logprobs": c.logprobs, "token_ids": c.token_ids}
                    for c in choices]
            return self._head("chat.completion") | {"choices": body, "usage": use}
        body = [{"index": c.index, "text": c.text, "finish_reason": c.finish_reason, "logprobs": c.logprobs,
                 "token_ids": c.token_ids} for c in choices]
        return self._head("text_completion") | {"choices": body, "usage": use}

    def chunk(self, delta: Delta, role: bool = False, use: dict | None = None) -> dict:
        if self.chat:
            content = ({"role": "assistant"} if role else {}) | {"content": delta.text}
            choice = {"index": delta.index, "delta": content, "finish_reason": delta.finish_reason,
                      "logprobs": delta.logprobs, "token_ids": delta.token_ids}
            body = self._head("chat.completion.chunk") | {"choices": [choice]}
        else:
            choice = {"index": delta.index, "text": delta.text, "finish_reason": delta.finish_reason,
                      "logprobs": delta.logprobs, "token_ids": delta.token_ids}
            body = self._head("text_completion") | {"choices": [choice]}
        return body if use is None else body | {"usage": use}

    def usage_chunk(self, use: dict) -> dict:
        return self._head("chat.completion.chunk" if self.chat else "text_completion") | {"choices": [], "usage": use}


def join(deltas: list[Delta], index: int) -> Delta:
    """One choice's deltas as one: its whole text, ids and logprobs."""
    logprobs = None
    for delta in deltas:
        if delta.logprobs is not None:
            logprobs = delta.logprobs if logprobs is None else {k: logprobs[k] + delta.logprobs[k] for k in logprobs}
    return Delta(index, "".join(d.text for d in deltas), [t for d in deltas for t in d.token_ids], logprobs,
                 deltas[-1].finish_reason if deltas else None)


def sse(data: dict | str) -> str:
    """One server-sent event: `data: JSON` (or the literal [DONE])."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n"
