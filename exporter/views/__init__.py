"""Human-readable views of pass graphs: text, Graphviz, ONNX, per-pass dumps."""
