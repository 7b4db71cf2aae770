"""Comparing packages: ABI diff of manifests, numeric verification by replay."""
