"""b12x passes: the graph rewrites a recipe may name, built on the runtime's rewrite kit."""
