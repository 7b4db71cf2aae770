"""The DeepSeek model as torch modules: blocks, layers, draft stages, pass modules, weights."""
