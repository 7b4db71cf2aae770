"""b12x passes: the pass manager and graph rewrites on torch.fx graphs."""
