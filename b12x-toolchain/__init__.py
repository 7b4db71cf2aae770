"""b12x: export speculative-decoding passes as versioned packages and replay them."""

__version__ = "0.1.0"
