"""Sessions: caller-owned buffers, input validation, graph replay per rows bucket."""
