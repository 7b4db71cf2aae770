"""Where the repository's folders are, for tests at any depth of tests/."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ROOT / "recipes"
EXAMPLES = ROOT / "examples"
SHIPPED_CHECKPOINT = ROOT / "checkpoints" / "dsv41-mini"  # the trained model, as shipped

# `benchmarks` is a folder of the repository, not an installed package: importable by the tests
# that drive it, after tests/ on the path (its packages must not shadow the tests' helpers).
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))
