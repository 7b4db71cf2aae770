"""Hugging Face import: config.json to recipe, checkpoint tensors to b12x weights."""
