"""Recipes: the YAML schema, its loader with line-numbered errors, derived dimensions."""
