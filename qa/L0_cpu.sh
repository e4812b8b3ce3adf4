#!/usr/bin/env bash
# CPU test suite (what CI runs): pure-torch reference kernels, inductor's CPU backend.
set -euo pipefail
cd "$(dirname "$0")/.."
export HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-ci}"
# -n: pytest-xdist workers (TE_PROTO_TEST_WORKERS, default 2: the CI machine's cores; 0 runs in
# this process). --durations: the slowest tests in the log, where the suite's time goes
python -m pytest tests -q -p no:cacheprovider -n "${TE_PROTO_TEST_WORKERS:-2}" --durations=25 "$@"
