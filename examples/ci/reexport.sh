#!/usr/bin/env bash
# Re-export every bundled recipe without weights and gate on ABI and bytes.
#
#   examples/ci/reexport.sh            # the CI job
#   examples/ci/reexport.sh --update   # after an intended change: refresh the committed fingerprints
#
# For each recipe: (1) structural export (no GPU, no weights); (2) `b12x abi diff` against
# the previous package — a committed manifest, or a package directory from the previous
# run when PREVIOUS points at one — fails on any calling-convention change unless
# ALLOW_ABI_CHANGE=1; (3) `b12x export --check` re-exports the recipe in a fresh process
# and fails unless the bytes equal the committed fingerprint (the manifest holds the
# sha256 of every file), naming the files that moved.
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
B12X="${B12X:-b12x}"
RECIPES="${RECIPES:-dsv4-tiny dsv41-tiny dsv41-mini dsv41}"
OUT="${OUT:-out/ci}"
JOBS="${JOBS:-2}"
FINGERPRINTS="${FINGERPRINTS:-$HERE/fingerprints}"
PREVIOUS="${PREVIOUS:-$FINGERPRINTS}"

for recipe in $RECIPES; do
  echo "== $recipe"
  "$B12X" export --recipe "$recipe" --weights none --out "$OUT" --jobs "$JOBS"
  package="$OUT/$recipe.b12x"
  committed="$FINGERPRINTS/$recipe.manifest.json"
  if [ "${1:-}" = "--update" ]; then
    cp "$package/manifest.json" "$committed"
    echo "updated $committed"
    continue
  fi

  previous="$PREVIOUS/$recipe.manifest.json"
  if [ -d "$PREVIOUS/$recipe.b12x" ]; then previous="$PREVIOUS/$recipe.b12x"; fi
  if ! "$B12X" abi diff "$previous" "$package"; then
    if [ "${ALLOW_ABI_CHANGE:-0}" != 1 ]; then
      echo "the ABI of $recipe moved; a new format major or ALLOW_ABI_CHANGE=1 is needed" >&2
      exit 1
    fi
    echo "ABI change allowed (ALLOW_ABI_CHANGE=1)"
  fi

  "$B12X" export --check "$committed" --recipe "$recipe" --jobs "$JOBS"
done
