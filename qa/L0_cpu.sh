#!/usr/bin/env bash
# CPU test suite (what CI runs): pure-torch reference kernels, inductor's CPU backend.
set -euo pipefail
cd "$(dirname "$0")/.."
export HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-ci}"
# --durations: the slowest tests in the log, where the suite's time goes
python -m pytest tests -q -p no:cacheprovider --durations=25 "$@"
