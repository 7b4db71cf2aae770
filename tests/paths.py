"""Where the repository's folders are, for tests at any depth of tests/."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ROOT / "recipes"
EXAMPLES = ROOT / "examples"
SHIPPED_CHECKPOINT = ROOT / "checkpoints" / "dsv41-mini"  # the trained model, as shipped
