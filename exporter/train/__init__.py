"""Training a small model that speaks: its corpus (the interpreter's own standard library)
and its byte-level BPE tokenizer."""
