"""b12x exporter: recipes, model definitions, capture, package writer and CLI."""
