#!/usr/bin/env bash
# Build the sdist and the wheel, check them, install the WHEEL (no extras, not editable) into a
# fresh virtual environment and run the installed program from outside the checkout: a module,
# template or py.typed missing from the package fails here.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
start=$(date +%s)

python .ci/extra-requirements.py release | python -m pip install -q -r /dev/stdin
rm -rf dist
python -m build --sdist --wheel --outdir dist . >/dev/null 2>&1 || python -m build --sdist --wheel --outdir dist .
python -m twine check --strict dist/*

version=$(python -c "import ast,sys; t=ast.parse(open('weft_sync/__init__.py').read()); \
print(next(n.value.value for n in t.body if isinstance(n, ast.Assign) \
and n.targets[0].id == '__version__'))")
wheel=$(ls dist/weft_sync-"$version"-*.whl)
sdist=$(ls dist/weft_sync-"$version".tar.gz)
echo "== built $wheel and $sdist"
python - "$wheel" <<'PY'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
for wanted in ("weft_sync/py.typed", "weft_sync/django/templates/admin/weft_sync/", "weft_sync/cli/"):
    if not any(name.startswith(wanted) for name in names):
        sys.exit(f"the wheel lacks {wanted}")
print(f"== the wheel holds {len(names)} files, py.typed and the admin templates among them")
PY

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q "$wheel"
cd "$work"  # away from the checkout: only the installed wheel can be imported
unset PYTHONPATH

shown=$("$work/venv/bin/weft-sync" --version)
[ "$shown" = "weft-sync $version" ] || { echo "weft-sync --version says '$shown'"; exit 1; }
echo "== $shown"
"$work/venv/bin/weft-sync" demo --workers 2 --workflows 4
"$work/venv/bin/python" "$root/.ci/smoke.py" "$work/venv"
echo "== package checks passed in $(( $(date +%s) - start )) s"
