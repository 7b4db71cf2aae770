"""What the fused window-snapshot append is qualified for.

The fused op was validated byte for byte against the unfused pair for these history
lengths and staging layouts only. Anything else is refused when a pass is prepared (at
export and again when a session binds buffers), never at replay.
"""

from __future__ import annotations

QUALIFIED_HISTORY = (128,)
QUALIFIED_LAYOUTS = ("NHD",)
QUALIFIED_PAGE_SIZES = (16, 32, 64, 128)


class UnsupportedConfiguration(ValueError):
    """A fused op asked for a history length or page layout it was not qualified for."""


def check_fused_window(history: int, layout: str, page_size: int, where: str = "") -> None:
    prefix = f"{where}: " if where else ""
    if history not in QUALIFIED_HISTORY:
        raise UnsupportedConfiguration(
            f"{prefix}fused window snapshot append: history length {history} is not supported; "
            f"qualified history lengths: {list(QUALIFIED_HISTORY)}"
        )
    if layout not in QUALIFIED_LAYOUTS:
        raise UnsupportedConfiguration(
            f"{prefix}fused window snapshot append: staging layout {layout!r} is not supported; "
            f"qualified layouts: {list(QUALIFIED_LAYOUTS)}"
        )
    if page_size not in QUALIFIED_PAGE_SIZES:
        raise UnsupportedConfiguration(
            f"{prefix}fused window snapshot append: staging page size {page_size} is not "
            f"supported; qualified page sizes: {list(QUALIFIED_PAGE_SIZES)}"
        )
