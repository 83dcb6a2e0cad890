#!/usr/bin/env bash
# The packed AVX-512 GEMM kernels of two revisions in one process, timed in turn (median of the
# rounds): csrc/qgemm_avx512.cpp at REV ("old", with its own gguf_pack.cpp) against the working
# tree ("new"), on random weights of one packed type (212: Q4_K x16, 214: Q6_K x16), N x K, for
# each row count; THREADS 1 or 2 (2: two threads taking chunks of 4096 rows, as ops.cpp does).
# Weights of N = 512, K = 1536 sit in L2 (the compute alone); N = 151936 is the 1.5B's LM head.
#
#   bash benchmarks/kernel_ab/run.sh REV TYPE N K "ROWS..." [ROUNDS] [THREADS]
#   bash benchmarks/kernel_ab/run.sh HEAD~1 214 512 1536 "1 2 4 5 8" 3001 1
set -euo pipefail
REV=$1 TYPE=$2 N=$3 K=$4 ROWS=$5 ROUNDS=${6:-15} THREADS=${7:-1}
ROOT=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
S=$ROOT/specserve/csrc
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
F="-O3 -ffp-contract=off -fno-math-errno -std=c++17"
A512="-mavx2 -mfma -mf16c -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni"
mkdir -p "$W/old"
for f in $(git -C "$ROOT" ls-tree --name-only "$REV" specserve/csrc/); do git -C "$ROOT" show "$REV:$f" > "$W/old/$(basename "$f")"; done
g++ $F -I"$S" -c "$S/qgemm_generic.cpp" -o "$W/gen.o"
g++ $F -I"$S" -c "$S/gguf_pack.cpp" -o "$W/pack.o"
g++ $F -I"$S" -mavx2 -mfma -mf16c -c "$S/qgemm_avx2.cpp" -o "$W/avx2.o"
g++ $F -I"$W/old" $A512 -c "$W/old/qgemm_avx512.cpp" -o "$W/old.o"
sed 's/namespace avx512 {/namespace avx512new {/; s/^}  \/\/ namespace avx512$/}  \/\/ namespace avx512new/' \
    "$S/qgemm_avx512.cpp" > "$W/new.cpp"
g++ $F -I"$S" $A512 -c "$W/new.cpp" -o "$W/new.o"
g++ $F -I"$S" -pthread "$(dirname "$0")/kernel_ab.cpp" "$W/gen.o" "$W/pack.o" "$W/avx2.o" "$W/old.o" "$W/new.o" -o "$W/ab"
for M in $ROWS; do "$W/ab" "$TYPE" "$N" "$K" "$M" "$ROUNDS" 0 "$THREADS"; done
