"""The exporter's error types, in a module that imports nothing of the project.

Every message names the recipe key, file, tensor or value at fault and what was expected;
the CLI prints it as one `error:` line.
"""


class ExportError(RuntimeError):
    """A pass cannot be exported as the recipe asks (a rewrite count, an unsupported layout)."""


class ReexportError(ValueError):
    """The package cannot be re-exported from what it records."""


class VerifyError(ValueError):
    """The packages cannot be compared (different ABI, unknown inputs)."""


class HfConfigError(ValueError):
    """config.json cannot be read, or cannot describe a b12x V4 model; the message starts with
    the file or the key at fault."""


class PromptError(ValueError):
    """A prompt given to `b12x run` cannot be served; names the file and line."""
