"""Prefix snapshots: codec, snapshot files, L1 memory and L2 disk caches."""
