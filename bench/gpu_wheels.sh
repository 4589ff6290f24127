#!/usr/bin/env bash
# Prepares .whl/: the wheels bench/gpu_check.sh installs on a GPU machine that has no network.
#
#     bench/gpu_wheels.sh            (run on a machine that reaches PyPI; PYTHON picks the pip)
#
# The GPU image already holds torch (CUDA build), transformers, tokenizers, typer, rich, numpy,
# matplotlib, pyyaml, sympy and packaging, but not pydantic or math-verify; peft is carried at
# marlow's own pin because the image's version is not known to fall inside marlow's range. Each
# wheel is downloaded at the version constraints.txt pins (what marlow is tested with), for
# CPython 3.12 on manylinux x86_64, without its dependencies (every one it needs is in the list
# or in the image). .whl/ is ignored by git: the wheels travel beside the working tree, and the
# tracked tree plus the wheels must stay within the 64 MiB that travels, which is checked here.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
OUT=.whl
LIMIT_MIB=64
PACKAGES=(
    pydantic pydantic_core annotated-types typing-inspection typing_extensions
    math-verify latex2sympy2_extended antlr4-python3-runtime
    peft
)

pins=()
for name in "${PACKAGES[@]}"; do
    # constraints.txt spells a name as pip freeze does; match '-', '_' and case alike
    pattern="^$(sed 's/[-_]/[-_]/g' <<<"$name")=="
    pin=$(grep -i -E "$pattern" constraints.txt) || {
        echo "gpu_wheels: $name is not pinned in constraints.txt" >&2
        exit 2
    }
    pins+=("$pin")
done

rm -rf "$OUT"
mkdir -p "$OUT"
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$OUT" "${pins[@]}"

count=$(find "$OUT" -type f -name '*.whl' | wc -l)
if [ "$count" -ne "${#PACKAGES[@]}" ]; then
    echo "gpu_wheels: expected ${#PACKAGES[@]} wheels in $OUT, found $count" >&2
    exit 1
fi
if ! git check-ignore -q "$OUT/"; then
    echo "gpu_wheels: $OUT/ is not ignored by git; add it to .gitignore" >&2
    exit 1
fi
wheels=$(du -sb "$OUT" | cut -f1)
# what travels besides: tracked files and untracked files git does not ignore
tree=$( (git ls-files -z; git ls-files -z --others --exclude-standard) |
    du --files0-from=- -cb 2>/dev/null | tail -1 | cut -f1)
mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }
echo "gpu_wheels: $count wheels, $(mib "$wheels") MiB in $OUT/; with the working tree" \
    "($(mib "$tree") MiB) $(mib $((wheels + tree))) MiB of the $LIMIT_MIB MiB that travel"
if [ $((wheels + tree)) -gt $((LIMIT_MIB * 1048576)) ]; then
    echo "gpu_wheels: over the $LIMIT_MIB MiB limit" >&2
    exit 1
fi
