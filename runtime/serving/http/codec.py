"""The server's text: the package's tokenizer (`Package.tokenizer`, a TextCodec, as `b12x run`
uses it), or none, when the server serves token ids only and answers text with a 400
(errors.NO_TOKENIZER). `AnswerText` turns the tokens a request gets, update by update, into
the text and token ids to send, cut at the first stop string.
"""

from __future__ import annotations


def encode_chat(codec, messages: list[dict]) -> list[int]:
    """The conversation's prompt ids; ValueError when the tokenizer has no chat template or a
    message does not fit it."""
    return codec.encode(codec.apply_chat_template(messages))


class AnswerText:
    """The answer's text and token ids, update by update, cut at the first stop string.

    `push(tokens)` returns the newly completed text that is safe to send, and the ids among
    `tokens` that belong to the answer: all of them, or once a stop string is found, those
    up to the one whose text completed it (a speculative step's update can carry tokens
    past it). Text that could still turn out to begin a stop string is held back until it
    cannot. `stopped` says a stop string was found; nothing after it is ever returned. A
    token the tokenizer has no text for (the model's vocabulary may be larger) adds none.
    """

    def __init__(self, codec, stop: list[str]):
        self._stream = codec.stream()
        self._vocab_size = codec.vocab_size
        self._stop = stop
        self._held = ""
        self.stopped = False

    def push(self, tokens: list[int]) -> tuple[str, list[int]]:
        text, answer = [], []
        for token in tokens:
            if self.stopped:
                break
            answer.append(token)
            if token < self._vocab_size:
                self._held += self._stream.push(token)
                text.append(self._release(final=False))
        return "".join(text), answer

    def finish(self) -> str:
        """What was held back, once no more tokens come (an unfinished character as U+FFFD)."""
        if self.stopped:
            return ""
        self._held += self._stream.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        found = [at for at in (self._held.find(stop) for stop in self._stop) if at >= 0]
        if found:
            self.stopped = True
            out, self._held = self._held[: min(found)], ""
            return out
        keep = 0 if final else max((k for stop in self._stop for k in range(1, len(stop))
                                    if self._held.endswith(stop[:k])), default=0)
        out, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep :]
        return out
