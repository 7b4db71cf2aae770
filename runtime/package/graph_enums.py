"""torch's serialised enums (dtype, layout, memory format, argument kind) and devices, as the values they name.

The tables are keyed by the integers a graph document holds, as torch's serialiser defines
them, not by the member names of `torch._export.serde.schema`'s enums: the serialiser only
ever adds values, but a release that predates one lacks its name (torch 2.11 has no
FLOAT8E8M0FNU, UINT32 or UINT64 scalar type), and reading a missing name at import would fail
every graph build. A test compares the tables with the installed torch's enums, name by name.
Kept here, not taken from the serialiser, so that building a graph does not import it
(graph_loader.py says why).
"""

from __future__ import annotations

import torch

from b12x_toolchain.runtime.errors import PackageError

# ScalarType: value -> dtype (the serialiser's member name in the comment). 0 is UNKNOWN: no dtype.
DTYPES = {
    1: torch.uint8,  # BYTE
    2: torch.int8,  # CHAR
    3: torch.int16,  # SHORT
    4: torch.int32,  # INT
    5: torch.int64,  # LONG
    6: torch.float16,  # HALF
    7: torch.float32,  # FLOAT
    8: torch.float64,  # DOUBLE
    9: torch.complex32,  # COMPLEXHALF
    10: torch.complex64,  # COMPLEXFLOAT
    11: torch.complex128,  # COMPLEXDOUBLE
    12: torch.bool,  # BOOL
    13: torch.bfloat16,  # BFLOAT16
    28: torch.uint16,  # UINT16
    29: torch.float8_e4m3fn,  # FLOAT8E4M3FN
    30: torch.float8_e5m2,  # FLOAT8E5M2
    31: torch.float8_e4m3fnuz,  # FLOAT8E4M3FNUZ
    32: torch.float8_e5m2fnuz,  # FLOAT8E5M2FNUZ
    33: torch.float8_e8m0fnu,  # FLOAT8E8M0FNU (not in torch 2.11's serialiser)
    34: torch.uint32,  # UINT32 (likewise)
    35: torch.uint64,  # UINT64 (likewise)
}
# Layout: value -> layout. 0 is Unknown.
LAYOUTS = {1: torch.sparse_coo, 2: torch.sparse_csr, 3: torch.sparse_csc, 4: torch.sparse_bsr, 5: torch.sparse_bsc,
           6: torch._mkldnn, 7: torch.strided}
# MemoryFormat: value -> memory format. 0 is Unknown.
MEMORY_FORMATS = {1: torch.contiguous_format, 2: torch.channels_last, 3: torch.channels_last_3d,
                  4: torch.preserve_format}
# ArgumentKind: how a node's named argument was passed. 0 (UNKNOWN, or no kind recorded) follows the op's schema.
POSITIONAL, KEYWORD = 1, 2


def _lookup(table: dict, value, what: str):
    # bool is an int to Python: `true` must not read as value 1.
    if type(value) is not int or value not in table:
        raise PackageError(f"{what} {value!r} is not one of torch's serialised values {sorted(table)}")
    return table[value]


def dtype(value) -> torch.dtype:
    return _lookup(DTYPES, value, "scalar type")


def layout(value) -> torch.layout:
    return _lookup(LAYOUTS, value, "layout")


def memory_format(value) -> torch.memory_format:
    return _lookup(MEMORY_FORMATS, value, "memory format")


def device(value: dict) -> torch.device:
    index = value.get("index")
    return torch.device(value["type"]) if index is None else torch.device(value["type"], index)
