#!/usr/bin/env bash
# Build the documentation site with warnings as errors: a broken reference, a page missing from
# a toctree or a docstring autodoc cannot render fails the build. The site documents this
# checkout (docs/conf.py puts it first on sys.path); only the docs extra's tools are installed.
set -euo pipefail
cd "$(dirname "$0")/.."

python .ci/extra-requirements.py docs | python -m pip install -q -r /dev/stdin
rm -rf docs/_build
start=$(date +%s)
python -m sphinx -W --keep-going -b html docs docs/_build/html
echo "== docs built in $(( $(date +%s) - start )) s: docs/_build/html/index.html"
