"""b12x benchmarks: paired measurements (baseline vs candidate) reported as ratios.

Nothing here is a pass/fail test; `python benchmarks/run.py` runs everything registered.
"""
