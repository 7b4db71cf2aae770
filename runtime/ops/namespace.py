"""The torch op namespace and version of b12x's op set.

Not `b12x`: FlashInfer's embedded kernel library and PyPI's `b12x` register ops under that
name, and two libraries defining one op name in one process cannot both load. The op set
is versioned as a whole; a package records the version its graphs call, and a runtime
loads only its own (README.md, "Format version policy"). Op set 5 adds the quantized
linears `fp8_block_linear` and `fp4_expert_linear` (quant_ops.py) to op set 4; op set 6
adds Engram's `engram_hash` and `engram_lookup` (engram_ops.py); op set 7 adds
`dense_linear` (quant_ops.py) and computes every op's row the same way whatever the rows
in the call (fixed_order.py).
"""

NAMESPACE = "b12x_toolchain"
OPSET_VERSION = 7
