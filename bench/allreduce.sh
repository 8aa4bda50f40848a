#!/usr/bin/env bash
# CPU all_reduce_sum (CpuGroup: ranks are threads over shared memory) against
# a copy_from_slice of the same buffer in the same run, for world 2 and 3 at
# 4 KiB .. 16 MiB, and the per-call latency of a 576-float allreduce
# (SmolLM2's hidden size: what tensor parallelism reduces twice per layer
# per token).
#   usage: bench/allreduce.sh
# Environment:
#   ALLREDUCE_REPS=n        samples per point, best wins (default 7)
#   ALLREDUCE_WORLDS="2,3"  rank counts (threads); more ranks than CPUs
#                           oversubscribes and mostly measures the scheduler
set -euo pipefail
repo=$(git -C "$(dirname "${BASH_SOURCE[0]}")" rev-parse --show-toplevel)
echo "== building and running engine/benches/allreduce.rs (release)" >&2
cd "$repo"
# The bench prints the table on stdout; cargo's progress goes to stderr.
cargo bench -q -p tandem-engine --bench allreduce
