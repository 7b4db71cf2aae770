"""The manifest's `cache_formats`: whose bytes each cache format of a package holds.

Every format a buffer names is recorded with its convention (formats/codecs.py), e.g.
"DeepSeek V4.1 window record (swa), flashinfer-python 0.7.4". A runtime reads a package's
caches only if its own codec of each format follows the same convention, so a package
written by a b12x whose records followed another FlashInfer release is refused by name,
not decoded with the wrong rounding.
"""

from __future__ import annotations

from b12x_toolchain.runtime.errors import PackageError
from b12x_toolchain.runtime.formats.codecs import FORMATS, get_format


def used_formats(buffers: dict) -> list[str]:
    """The formats a buffer table (name -> BufferInfo) names."""
    return sorted({info.format for info in buffers.values() if info.format})


def cache_formats_entry(buffers: dict) -> dict[str, str]:
    """The manifest entry for a buffer table: format name -> convention."""
    return {name: get_format(name).convention for name in used_formats(buffers)}


def check_cache_formats(recorded, buffers: dict) -> None:
    """`recorded`: the manifest's cache_formats as written; `buffers`: its typed buffer table."""
    if not isinstance(recorded, dict) or not all(isinstance(v, str) for v in recorded.values()):
        raise PackageError("manifest.json: 'cache_formats' is missing or not an object of format conventions")
    used = used_formats(buffers)
    for name in used:  # contract.py checked they are FORMATS
        if name not in recorded:
            raise PackageError(f"manifest.json: cache_formats does not say whose bytes format {name!r} holds")
        if recorded[name] != FORMATS[name].convention:
            raise PackageError(f"manifest.json: cache format {name!r} holds {recorded[name]!r}; this runtime "
                               f"reads and writes {FORMATS[name].convention!r}: re-export the package with "
                               f"this version of b12x")
    extra = sorted(set(recorded) - set(used))
    if extra:
        raise PackageError(f"manifest.json: cache_formats names {extra}, which no buffer uses")
