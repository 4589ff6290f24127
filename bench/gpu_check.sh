#!/usr/bin/env bash
# The GPU check on a machine with one CUDA GPU and no network: installs the carried wheels into a
# private folder, then runs bench/gpu_check.py on marlow from this working tree (not installed).
#
#     bench/gpu_check.sh [--no-wheels] OUT [gpu_check.py options]    e.g. bench/gpu_check.sh "$OUT"
#
# Writes OUT/gpu_check.json and OUT/gpu_check.log (the wheel install, then every step of the
# check), within gpu_check.py's time budget (--budget-s, 550 s by default). The wheels in .whl/
# come from bench/gpu_wheels.sh, run beforehand where PyPI is reachable; with --no-wheels (or no
# .whl/) the environment's own packages are used (a CPU dry run: --device cpu --dry-run). PYTHON
# names the interpreter (default python3, the one that holds the CUDA build of torch). The JSON
# is written whatever fails; the exit status is the driver's.
set -uo pipefail
use_wheels=1
if [ "${1:-}" = --no-wheels ]; then
    use_wheels=0
    shift
fi
if [ $# -lt 1 ] || [[ $1 == -* ]]; then
    echo "usage: bench/gpu_check.sh [--no-wheels] OUT [gpu_check.py options]" >&2
    exit 2
fi
out=$(realpath -m "$1") # before the cd: OUT is relative to where the script was called from
shift
cd "$(dirname "$0")/.."
wheels=(.whl/*.whl)
PYTHON=${PYTHON:-python3}
mkdir -p "$out"
log=$out/gpu_check.log
json=$out/gpu_check.json
rm -f "$json"

fail() { # the JSON the driver could not write, and its line
    printf '{"error": "%s"}\n' "$1" >"$json"
    echo "gpu_check: $1" | tee -a "$log" >&2
    exit 1
}

if [ $use_wheels = 1 ] && [ -e "${wheels[0]}" ]; then
    site=$(mktemp -d /tmp/marlow-site.XXXXXX)
    trap 'rm -rf "$site"' EXIT
    export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
    echo "gpu_check: installing ${#wheels[@]} wheels from .whl/ into $site" | tee -a "$log"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" "${wheels[@]}" >>"$log" 2>&1 ||
        fail "installing the wheels of .whl/ failed; see gpu_check.log"
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
export HF_HUB_OFFLINE=1 # no network there: nothing may wait on the hub

"$PYTHON" bench/gpu_check.py --out "$out" "$@"
rc=$?
[ -s "$json" ] || fail "bench/gpu_check.py exited with status $rc before writing its JSON; see gpu_check.log"
exit $rc
