"""Tensor and expert parallel packages: the mapping as data, and the process group a rank replays in."""
