"""The choices of one answer, update by update: text cut at stop strings, token ids, logprobs
shaped as each API reports them, finish reasons and the usage so far.

Completions logprobs are `{tokens, token_logprobs, top_logprobs, text_offset}` (with `echo`
the prompt's tokens come first, the very first with no logprob); chat logprobs are
`{content: [{token, logprob, bytes, top_logprobs}]}`. A token's string is its text alone
(`token_id:N` where the package has no tokenizer). Completions' top_logprobs also hold the
chosen token, as vLLM's do.
"""

from __future__ import annotations

from dataclasses import dataclass

from b12x_toolchain.runtime.serving.http.codec import AnswerText
from b12x_toolchain.runtime.serving.http.engine_loop import Update
from b12x_toolchain.runtime.serving.http.protocol import Generation
from b12x_toolchain.runtime.serving.requests import TokenLogprob


@dataclass
class Delta:
    """What one update adds to a choice."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: dict | None
    finish_reason: str | None = None


class Choice:
    def __init__(self, index: int, generation: Generation, codec):
        self.index, self.codec, self.chat = index, codec, generation.chat
        self.wants_logprobs = generation.logprobs is not None
        self.text = AnswerText(codec, generation.stop_strings) if codec is not None else None
        self.prompt = generation.prompts[index // generation.n]
        self.echo = generation.echo
        self.finish_reason: str | None = None
        self.completion_tokens = self.cached_tokens = 0
        self.offset = 0  # text_offset of the next token (completions)

    def push(self, update: Update, cancel) -> Delta:
        """This update's delta; a stop string found in it calls cancel() (the engine stops the
        request), and the delta then ends there."""
        head, head_logprobs = "", None
        if self.echo and update.first:  # the prompt before the first tokens
            head = self.codec.decode(self.prompt) if self.codec is not None else ""
            if self.wants_logprobs:
                head_logprobs = self._completion_logprobs(self.prompt, [None] + list(update.prompt_logprobs or []))
        if self.text is None:
            piece, ids = "", list(update.tokens)
        else:
            piece, ids = self.text.push(update.tokens)
            if self.text.stopped and update.finish_reason is None:
                cancel()
            if update.finish_reason is not None:
                piece += self.text.finish()
        self.completion_tokens, self.cached_tokens = update.completion_tokens, update.cached_tokens
        if update.finish_reason is not None:
            self.finish_reason = "stop" if self.text is not None and self.text.stopped else update.finish_reason
        logprobs = None
        if self.wants_logprobs:
            entries = list(update.logprobs or [])[: len(ids)]
            logprobs = self._chat_logprobs(ids, entries) if self.chat else self._completion_logprobs(ids, entries)
            if head_logprobs is not None:
                logprobs = {key: head_logprobs[key] + logprobs[key] for key in logprobs}
        return Delta(self.index, head + piece, ids, logprobs, self.finish_reason)

    def token_string(self, token: int) -> str:
        if self.codec is None:
            return f"token_id:{token}"
        return self.codec.decode([token]) if token < self.codec.vocab_size else ""

    def _completion_logprobs(self, ids: list[int], entries: list[TokenLogprob | None]) -> dict:
        body = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, entry in zip(ids, entries):
            text = self.token_string(token)
            body["tokens"].append(text)
            body["text_offset"].append(self.offset)
            self.offset += len(text)
            if entry is None:
                body["token_logprobs"].append(None)
                body["top_logprobs"].append(None)
                continue
            body["token_logprobs"].append(entry.logprob)
            top = {}
            for alternative, value in entry.top:  # two ids of one text: the likelier one's value
                top.setdefault(self.token_string(alternative), value)
            top.setdefault(text, entry.logprob)
            body["top_logprobs"].append(top)
        return body

    def _chat_logprobs(self, ids: list[int], entries: list[TokenLogprob]) -> dict:
        def item(token: int, value: float) -> dict:
            text = self.token_string(token)
            return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8", "replace"))}

        return {"content": [item(t, e.logprob) | {"top_logprobs": [item(a, v) for a, v in e.top]}
                            for t, e in zip(ids, entries)]}


class Answer:
    """Every choice of one request; `usage()` sums them (each prompt counted once)."""

    def __init__(self, generation: Generation, codec):
        self.generation = generation
        self.choices = [Choice(i, generation, codec) for i in range(len(generation.requests))]

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    def usage(self) -> dict:
        prompt = sum(len(p) for p in self.generation.prompts)
        completion = sum(c.completion_tokens for c in self.choices)
        cached = sum(c.cached_tokens for c in self.choices[:: self.generation.n])
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}
