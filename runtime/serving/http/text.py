"""The one place the server meets the package's tokenizer (runtime/serving/text.py's TextCodec).

`load_codec(package)` is the codec, or None when the runtime has no text support or the
package ships no tokenizer; the server then serves token ids only and answers text with
a 400 (errors.NO_TOKENIZER).
"""

from __future__ import annotations


def load_codec(package):
    try:
        from b12x_toolchain.runtime.serving.text import TextCodec
    except ImportError:  # a runtime without text support: token ids only
        return None
    return TextCodec.from_package(package)


class TextStream:
    """Text of a growing token sequence, cut before the first stop string.

    `push(tokens)` returns the newly completed text that is safe to send: text that could
    still turn out to begin a stop string is held back until it cannot. `stopped` says a
    stop string was found; nothing after it is ever returned.
    """

    def __init__(self, codec, stop: list[str]):
        self._stream = codec.stream()
        self._stop = stop
        self._held = ""
        self.stopped = False

    def push(self, tokens: list[int]) -> str:
        if self.stopped:
            return ""
        for token in tokens:
            self._held += self._stream.push(token)
        found = [at for at in (self._held.find(stop) for stop in self._stop) if at >= 0]
        if found:
            self.stopped = True
            out, self._held = self._held[: min(found)], ""
            return out
        keep = max((k for stop in self._stop for k in range(1, len(stop)) if self._held.endswith(stop[:k])), default=0)
        out, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep :]
        return out

    def finish(self) -> str:
        """What was held back, once no more tokens come."""
        out, self._held = ("" if self.stopped else self._held), ""
        return out
