"""Graph rewrite building blocks."""
