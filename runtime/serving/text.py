"""Text in and out of a model: a package's tokenizer as a codec, streaming, chat templates.

A package may carry a Hugging Face tokenizer (`tokenizer/tokenizer.json`, and
`tokenizer/tokenizer_config.json` with the chat template and the eos and pad tokens);
`TextCodec.from_package` reads it from the bytes `load` checked against the manifest.
Nothing from the package is executed: tokenizer.json is data for the `tokenizers` library,
and the chat template is rendered in Jinja's immutable sandbox, where reaching for an
object's internals (`''.__class__`) is an error instead of an empty string.

Decoding keeps special tokens (`<|endoftext|>` shows as itself), so decode(encode(t)) == t
for every text t, special-token text included.
"""

from __future__ import annotations

from typing import Sequence

from b12x_toolchain.runtime.strict_json import StrictJsonError, loads

TOKENIZER_FILE, CONFIG_FILE = "tokenizer.json", "tokenizer_config.json"
REPLACEMENT = "\ufffd"  # what the byte-level decoder makes of an incomplete UTF-8 sequence


class TextCodec:
    """encode / decode with one tokenizer, its eos and pad ids and its chat template."""

    def __init__(self, tokenizer_json: str, *, eos_token: str | None = None, pad_token: str | None = None,
                 chat_template: str | None = None, source: str = TOKENIZER_FILE):
        from tokenizers import Tokenizer

        try:
            self._tokenizer = Tokenizer.from_str(tokenizer_json)
        except Exception as exc:  # tokenizers raises a bare Exception for a malformed file
            raise ValueError(f"{source}: not a tokenizer the tokenizers library reads ({exc})") from None
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_id, self.pad_id = (self._token_id(t, field, source) for t, field in
                                    ((eos_token, "eos_token"), (pad_token, "pad_token")))
        self.chat_template = chat_template
        self._template = None  # compiled on first use: a broken template does not stop id prompts

    def _token_id(self, token: str | None, field: str, source: str) -> int | None:
        if token is None:
            return None
        found = self._tokenizer.token_to_id(token)
        if found is None:
            raise ValueError(f"{source}: {field} {token!r} is not a token of its tokenizer.json")
        return found

    @classmethod
    def from_files(cls, tokenizer_json: bytes, config_json: bytes | None = None,
                   source: str = "") -> "TextCodec":
        """The codec of a tokenizer.json and an optional tokenizer_config.json (their bytes);
        `source` prefixes the file names in errors (a folder or package)."""
        where = f"{source}/" if source else ""
        config = read_tokenizer_config(config_json, where + CONFIG_FILE) if config_json is not None else {}
        try:
            text = tokenizer_json.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{where}{TOKENIZER_FILE}: not UTF-8 text") from None
        return cls(text, source=where + TOKENIZER_FILE, **config)

    @classmethod
    def from_package(cls, package) -> "TextCodec | None":
        """The codec of a loaded package's tokenizer (its files as `load` checked them), or
        None when the package carries none; a PackageError names the package and file."""
        from b12x_toolchain.runtime.errors import PackageError

        facts = package.manifest.tokenizer
        if facts is None:
            return None
        files = package.tokenizer_files
        try:
            where = f"{package.path.name}/{facts.file.rpartition('/')[0]}".rstrip("/")
            codec = cls.from_files(files[facts.file], files.get(facts.config), source=where)
        except ValueError as exc:
            raise PackageError(str(exc)) from None
        if (codec.eos_id, codec.pad_id, codec.chat_template is not None) != \
                (facts.eos_token_id, facts.pad_token_id, facts.chat_template):
            raise PackageError(f"{package.path.name}: the tokenizer's eos, pad or chat template differ from "
                               "manifest.json's tokenizer section")
        return codec

    # -- tokens -----------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text {text!r:.80}: expected a string")
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        ids = list(ids)
        bad = next((i for i in ids if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.vocab_size),
                   None)
        if bad is not None:
            raise ValueError(f"token id {bad!r}: expected an integer in [0, {self.vocab_size})")
        return self._tokenizer.decode(ids, skip_special_tokens=False)

    def stream(self) -> "TextStream":
        """An incremental decoder: push ids one at a time, get the text each completes."""
        return TextStream(self)

    # -- chat -------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The conversation rendered by the tokenizer's chat template (as Hugging Face renders
        it: trim_blocks, lstrip_blocks). A ValueError names what is wrong: no template, a
        malformed message, or the template's own error (the sandbox's refusals included)."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat_template (tokenizer_config.json)")
        _check_messages(messages)
        import jinja2

        try:
            if self._template is None:
                self._template = _sandbox().from_string(self.chat_template)
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         eos_token=self.token(self.eos_id),
                                         pad_token=self.token(self.pad_id))
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template: {type(exc).__name__}: {exc}") from None

    def token(self, token_id: int | None) -> str | None:
        """The token's own string in the vocabulary (None for None)."""
        return None if token_id is None else self._tokenizer.id_to_token(token_id)


class TextStream:
    """Incremental detokenization for streaming. Byte-level BPE splits multi-byte characters
    over tokens, so the text of the ids so far may end in half a character: `push` holds it
    back until a later token completes it. Only the ids since the last complete boundary
    are decoded again, so a push costs the same however long the text is."""

    def __init__(self, codec: TextCodec):
        self._decode = codec.decode
        self._ids: list[int] = []
        self._start = 0  # ids[_start:_done] decode to text already returned; _start is a clean boundary
        self._done = 0

    def push(self, token_id: int) -> str:
        """The text `token_id` completes ("" while a character is still incomplete)."""
        self._ids.append(token_id)
        before = self._decode(self._ids[self._start:self._done])
        text = self._decode(self._ids[self._start:])
        if len(text) <= len(before) or text.endswith(REPLACEMENT):
            return ""
        self._start, self._done = self._done, len(self._ids)
        return text[len(before):]

    def flush(self) -> str:
        """Whatever is held back, as the full decode shows it (an unfinished character as U+FFFD)."""
        before = self._decode(self._ids[self._start:self._done])
        text = self._decode(self._ids[self._start:])
        self._start = self._done = len(self._ids)
        return text[len(before):]


def read_tokenizer_config(data: bytes, source: str) -> dict:
    """The fields of a tokenizer_config.json the codec uses: eos_token, pad_token and
    chat_template (each may be absent; a token may be a string or {"content": ...})."""
    try:
        config = loads(data)
    except (StrictJsonError, UnicodeDecodeError) as exc:
        raise ValueError(f"{source}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{source}: expected a JSON object")
    out = {}
    for field in ("eos_token", "pad_token"):
        token = config.get(field)
        if isinstance(token, dict):
            token = token.get("content")
        if token is not None and not isinstance(token, str):
            raise ValueError(f"{source}: {field} {config[field]!r:.80}: expected a token string")
        out[field] = token
    template = config.get("chat_template")
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{source}: chat_template {template!r:.80}: expected one template string")
    out["chat_template"] = template
    return out


def _check_messages(messages) -> None:
    if not isinstance(messages, list):
        raise ValueError(f"messages {messages!r:.80}: expected a list of {{'role', 'content'}} objects")
    for i, message in enumerate(messages):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise ValueError(f"messages[{i}] {message!r:.80}: expected an object with string 'role' and 'content'")


def _sandbox():
    """Jinja's immutable sandbox, set as Hugging Face sets it, whose refusals raise."""
    from jinja2.exceptions import SecurityError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Sandbox(ImmutableSandboxedEnvironment):
        def unsafe_undefined(self, obj, attribute):
            # Jinja's default renders an unsafe attribute as an empty string; a template
            # that reaches for internals is broken or hostile, and is refused as such.
            raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

    return Sandbox(trim_blocks=True, lstrip_blocks=True)
