"""b12x runtime: op set, cache formats, package reader, sessions, serving and prefix caches.

A server imports only this package; nothing of the exporter or the passes is loaded.
The names below are the public API; each is imported on first use, so that
`import b12x_toolchain.runtime.formats.codecs` does not pull in torch.export machinery.
"""

from importlib import import_module

_PUBLIC = {
    "load": "package.reader",
    "Package": "package.reader",
    "PackageError": "package.reader",
    "read_manifest": "package.reader",
    "Manifest": "package.manifest",
    "Session": "session.session",
    "Engine": "serving.engine",
    "EngineOptions": "serving.options",
    "open_engine": "serving.options",
    "open_prefix_cache": "serving.options",
    "Decoder": "serving.speculative",
    "Request": "serving.requests",
    "RequestState": "serving.requests",
    "PrefixCache": "prefix.cache",
    "TextCodec": "serving.text",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name):
    if name in _PUBLIC:
        return getattr(import_module(f"{__name__}.{_PUBLIC[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
