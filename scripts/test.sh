#!/usr/bin/env bash
# The test command of README.md (CI runs exactly this).
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 -m pytest -q -p no:cacheprovider tests "$@"
