"""b12x runtime: op set, cache layouts, package reader, sessions and replay.

A server imports only this package; nothing of the exporter or the passes is loaded.
"""

__all__ = ["Package", "PackageError", "load"]


def __getattr__(name):
    # Lazy so that `import b12x_toolchain.runtime.formats` does not pull in torch.export machinery.
    if name in __all__:
        from b12x_toolchain.runtime import package

        return getattr(package, name)
    raise AttributeError(f"module 'b12x_toolchain.runtime' has no attribute {name!r}")
