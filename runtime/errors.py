"""The runtime's error types, in a module that imports nothing of the project.

Every message names the file, field, buffer or value at fault and what was expected.
Kept apart so that the modules raising them need not import each other.
"""


class PackageError(ValueError):
    """The package cannot be used: names the file or field and what was expected."""


class CheckpointError(PackageError):
    """The checkpoint cannot serve the package: names the tensor or file and what was expected."""


class BufferError(ValueError):
    """A caller-owned cache or staging buffer does not match the package's spec."""


class InputError(ValueError):
    """A replay's input values are out of range or do not fit the pass."""


class SnapshotError(ValueError):
    """A snapshot cannot be taken or hydrated; the message names the cache and the value."""


class LayoutError(SnapshotError):
    """The package has a cache the codec does not know how to snapshot."""


class PagesExhausted(InputError):
    """The pages a request or pass needs cannot be had now; nothing was written."""
