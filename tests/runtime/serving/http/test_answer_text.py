"""The server's answer text: cut at the first stop string, with the answer's token ids cut
there too, however the tokens arrive (a speculative step brings several at once)."""

from __future__ import annotations

from b12x_toolchain.runtime.serving.http.codec import AnswerText
from b12x_toolchain.runtime.serving.text import TextCodec
from paths import SHIPPED_CHECKPOINT

TEXT = "    return value\n\ndef main():\n    pass\n"
STOP = "\n\n"


def codec() -> TextCodec:
    return TextCodec.from_files((SHIPPED_CHECKPOINT / "tokenizer.json").read_bytes(),
                                (SHIPPED_CHECKPOINT / "tokenizer_config.json").read_bytes())


def answer(codec: TextCodec, tokens: list[int], update: int) -> tuple[str, list[int]]:
    text, ids, cut = [], [], AnswerText(codec, [STOP])
    for start in range(0, len(tokens), update):
        piece, kept = cut.push(tokens[start:start + update])
        text.append(piece)
        ids += kept
    text.append(cut.finish())
    assert cut.stopped
    return "".join(text), ids


def test_text_and_ids_stop_where_the_stop_string_is_completed_whatever_the_updates():
    shipped = codec()
    tokens = shipped.encode(TEXT)
    for update in (1, 3, 8, len(tokens)):  # one token a step, speculative steps, everything at once
        text, ids = answer(shipped, tokens, update)
        assert text == TEXT[: TEXT.index(STOP)], update
        # The ids end with the token that completed the stop string: none of `def main` is in them.
        assert ids == tokens[: len(ids)] and len(ids) < len(tokens), update
        assert STOP in shipped.decode(ids) and STOP not in shipped.decode(ids[:-1]), update


def test_without_a_stop_string_every_token_and_all_the_text_come_through():
    shipped = codec()
    tokens = shipped.encode(TEXT)
    cut = AnswerText(shipped, [])
    text, ids = cut.push(tokens)
    assert text + cut.finish() == TEXT and ids == tokens and not cut.stopped
