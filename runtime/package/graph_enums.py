"""torch's serialised enums (dtype, layout, memory format) and devices, as the values they name.

The same tables as torch's serialiser keeps (a test compares them), here so that building a
graph does not import it (graph_loader.py says why).
"""

from __future__ import annotations

import torch
from torch._export.serde.schema import Layout, MemoryFormat, ScalarType

_S = ScalarType
DTYPES = {_S.BYTE: torch.uint8, _S.CHAR: torch.int8, _S.UINT16: torch.uint16, _S.SHORT: torch.int16,
          _S.INT: torch.int32, _S.LONG: torch.int64, _S.HALF: torch.float16, _S.FLOAT: torch.float32,
          _S.DOUBLE: torch.float64, _S.COMPLEXHALF: torch.complex32, _S.COMPLEXFLOAT: torch.complex64,
          _S.COMPLEXDOUBLE: torch.complex128, _S.BOOL: torch.bool, _S.BFLOAT16: torch.bfloat16,
          _S.FLOAT8E4M3FN: torch.float8_e4m3fn, _S.FLOAT8E5M2: torch.float8_e5m2,
          _S.FLOAT8E4M3FNUZ: torch.float8_e4m3fnuz, _S.FLOAT8E5M2FNUZ: torch.float8_e5m2fnuz,
          _S.FLOAT8E8M0FNU: torch.float8_e8m0fnu, _S.UINT32: torch.uint32, _S.UINT64: torch.uint64}
LAYOUTS = {Layout.SparseCoo: torch.sparse_coo, Layout.SparseCsr: torch.sparse_csr, Layout.SparseCsc: torch.sparse_csc,
           Layout.SparseBsr: torch.sparse_bsr, Layout.SparseBsc: torch.sparse_bsc, Layout._mkldnn: torch._mkldnn,
           Layout.Strided: torch.strided}
MEMORY_FORMATS = {MemoryFormat.ContiguousFormat: torch.contiguous_format, MemoryFormat.ChannelsLast: torch.channels_last,
                  MemoryFormat.ChannelsLast3d: torch.channels_last_3d,
                  MemoryFormat.PreserveFormat: torch.preserve_format}


def dtype(value: int) -> torch.dtype:
    return DTYPES[ScalarType(value)]


def device(value: dict) -> torch.device:
    index = value.get("index")
    return torch.device(value["type"]) if index is None else torch.device(value["type"], index)
