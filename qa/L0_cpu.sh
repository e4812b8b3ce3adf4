#!/usr/bin/env bash
# CPU test suite (what CI runs): pure-torch reference kernels, inductor's CPU backend.
set -euo pipefail
cd "$(dirname "$0")/.."
export HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-ci}"
python -m pytest tests -q -p no:cacheprovider "$@"
