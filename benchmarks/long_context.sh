#!/usr/bin/env bash
# Issue #31's long-context quality, one documented command (heavy: hours on 2 cores; run alone):
#   bash benchmarks/long_context.sh PKG [CONTEXTS] [PASSKEY_CONTEXTS] [BUDGETS] [SEEDS]
# PKG: a package of a 32K model, e.g. Qwen2.5-Coder-0.5B-Instruct exported from its GGUF
# (bash scripts/setup_qwen.sh; tinyserve-export <gguf> -o PKG). Runs `tinyserve eval` - the
# package's own runtime - on two texts at each context: Hamlet first (the selection defaults were
# chosen on KJV Genesis with Qwen: benchmarks/results/selection_probe.md), then KJV Genesis, the last
# 512 positions teacher-forced against dense at BUDGETS (a comma list; default: the package's own
# budget); then passkey retrieval at 5 depths x SEEDS (default 0,1). An empty CONTEXTS or
# PASSKEY_CONTEXTS ("") skips that part. Appends each table to benchmarks/results/long_context.md.
set -euo pipefail
cd "$(dirname "$0")/.."
PKG=${1:?usage: bash benchmarks/long_context.sh PKG [CONTEXTS] [PASSKEY_CONTEXTS] [BUDGETS] [SEEDS]}
CONTEXTS=${2-16384,32768}
PASSKEY=${3-16384,32768}
BUDGETS=(${4:+--budgets "$4"})
SEEDS=${5:-0,1}
OUT=benchmarks/results/long_context.md
HAMLET=$(python3 -c "from tinyserve_dev.evaluation.texts import default_text_path; print(default_text_path())")
KJV=$(python3 -m tinyserve_dev.evaluation.texts kjv)
[ -f "$OUT" ] || printf '# Long-context quality through the runtime (tinyserve eval)\n\n' > "$OUT"
run() {
  local tmp commit; tmp=$(mktemp); commit=$(git rev-parse --short HEAD)  # the code the run loads
  /usr/bin/time -f "wall %e s, peak RSS %M KiB" python3 -m tinyserve_trt.runtime.cli eval "$PKG" "$@" --out "$tmp" \
    2> >(tail -n 1 > "$tmp.time")
  wait
  { printf '\n<!-- %s -->\nCommand: `tinyserve eval %s %s` (%s, commit %s; %s)\n\n' "$(date -u +%FT%TZ)" "$(basename "$PKG")" \
      "$*" "$(uname -m), $(nproc) cores" "$commit" "$(cat "$tmp.time")"; tail -n +4 "$tmp"; } >> "$OUT"
  rm -f "$tmp" "$tmp.time"
}
for ctx in ${CONTEXTS//,/ }; do
  run --text "$HAMLET" --context "$ctx" "${BUDGETS[@]}"
  run --text "$KJV" --context "$ctx" "${BUDGETS[@]}"
done
for ctx in ${PASSKEY//,/ }; do
  run --passkey --context "$ctx" "${BUDGETS[@]}" --depths 0,0.25,0.5,0.75,1 --seeds "$SEEDS"
done
