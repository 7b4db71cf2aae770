"""Bundled export recipes (YAML files shipped as package data)."""
