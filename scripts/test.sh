#!/usr/bin/env bash
# The test command of README.md (CI runs exactly this).
# -X faulthandler: pytest's own handler stops at the session's end; this one stays on, so a
# crash while the process exits (native threads, library teardown) prints every thread's stack.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 -X faulthandler -m pytest -q -p no:cacheprovider tests "$@"
