#!/usr/bin/env bash
# Screenshots of docs pages as a phone and a laptop show them: builds the site, then headless
# Chromium (Debian's chromium-headless-shell: apt-get install chromium-headless-shell) shoots each
# page at each width in a window 16000 px tall (a page longer than that is cut there).
# Usage: bash scripts/screenshots.sh OUT_DIR [PAGE ...]   (PAGE: a docs page without .md; default results)
# Widths: WIDTHS="390 1280" (the default). Nothing here is a test: look at the PNGs.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: bash scripts/screenshots.sh OUT_DIR [PAGE ...]}"; shift
pages=("${@:-results}")
browser="$(command -v chromium-headless-shell || command -v chromium || true)"
if [[ -z "$browser" ]]; then
  echo "screenshots: no headless Chromium; install it: apt-get install chromium-headless-shell" >&2
  exit 1
fi
site="$(mktemp -d)"
trap 'rm -rf "$site"' EXIT
NO_MKDOCS_2_WARNING=1 .venv/bin/python -m mkdocs build --strict --quiet --site-dir "$site"
mkdir -p "$out"
for page in "${pages[@]}"; do
  for width in ${WIDTHS:-390 1280}; do
    "$browser" --no-sandbox --disable-gpu --hide-scrollbars --window-size="$width,16000" \
      --screenshot="$out/$page-$width.png" "file://$site/$page/index.html" >/dev/null 2>&1
    echo "$out/$page-$width.png"
  done
done
