#!/usr/bin/env bash
# The test command: install what is needed, then run the whole suite; then the tests that train a drafter (marker
# `trained`) once more under torch's portable kernels (ATEN_CPU_CAPABILITY=default), so no test can pass on one
# CPU's vector kernels (AVX2, AVX-512) and fail on another's. pytest's "no tests collected" (5) is success.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh || exit 1
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
.venv/bin/python -m pytest -q "$@"
rc=$?
[ "$rc" -eq 5 ] && rc=0
[ "$rc" -eq 2 ] && exit "$rc"  # interrupted: no second pass
ATEN_CPU_CAPABILITY=default .venv/bin/python -m pytest -q -m trained -p no:cacheprovider "$@"
rc2=$?
[ "$rc2" -eq 5 ] && rc2=0
[ "$rc" -eq 0 ] && rc=$rc2
exit "$rc"
