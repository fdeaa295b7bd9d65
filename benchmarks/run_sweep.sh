#!/usr/bin/env bash
# The full sweep behind docs/benchmarks.md, part by part, in priority order, each part bounded
# by what is left before a deadline (SWEEP_MINUTES, default 50) so the run ends on time; a part
# stopped early keeps the points it finished (sweep.py rewrites its JSON after every point).
# Then renders docs/benchmarks.md and docs/benchmarks/*.png.
#
#   benchmarks/run_sweep.sh            # about 50 minutes on a shared 2-CPU machine
set -u
cd "$(dirname "$0")/.."
PY=.venv/bin/python
deadline=$(( $(date +%s) + 60 * ${SWEEP_MINUTES:-50} ))

part() {
    local left=$(( deadline - $(date +%s) ))
    if [ "$left" -lt 90 ]; then
        echo "sweep: no time left for: $*" >&2
        return
    fi
    echo "sweep: $* (${left}s left)" >&2
    timeout --signal=INT --kill-after=30 "$left" "$PY" benchmarks/sweep.py run "$@" || echo "sweep: stopped: $*" >&2
}

part --part sizes --sizes-mib 256,1024 --rounds 3
part --part s3 --sizes-mib 256 --rounds 2
part --part counts --counts 10,100,1000,10000 --count-size-mib 128 --rounds 1
part --part compression --sizes-mib 512 --rounds 2
part --part sizes --sizes-mib 4096 --rounds-large 1 --out benchmarks/results/sweep-sizes-4g.json
part --part s3 --sizes-mib 1024 --rounds 1 --out benchmarks/results/sweep-s3-1g.json
"$PY" benchmarks/sweep.py render
