"""Cache formats (byte codecs) and cache layouts."""
