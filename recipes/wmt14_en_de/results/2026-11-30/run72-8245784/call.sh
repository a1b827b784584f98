#!/usr/bin/env bash
# session 20 call 4: harnesses (embedding: main vs HEAD; softmax: main vs HEAD, T = 32), then the full GPU
# check of HEAD (build, all GPU tests, bench_ops fp16 and bf16).
set -u
R=$PWD; K=$R/.device-kit/calls/s20; V=/tmp/v
mkdir -p $V $OUT/h
for v in S0 S10 E0 E11; do mkdir -p $V/$v; done
cp .device-kit/variants/main20/ls_fairseq/csrc/* $V/E0/; cp .device-kit/variants/main20/ls_fairseq/csrc/* $V/S0/
cp ls_fairseq/csrc/* $V/S10/; cp ls_fairseq/csrc/* $V/E11/
for v in S0 S10; do (cd $V/$v && nvcc -std=c++20 -O3 -arch=sm_90 --expt-relaxed-constexpr -I . $K/smx.cu -o smx > nvcc.log 2>&1 || echo "$v compile failed") & done
for v in E0 E11; do (cd $V/$v && nvcc -std=c++20 -O3 -arch=sm_90 --expt-relaxed-constexpr -I . $K/embd.cu -o embd > nvcc.log 2>&1 || echo "$v compile failed") & done
wait
for r in 1 2; do for v in S0 S10; do $V/$v/smx $v; done; done | grep "T   32" > $OUT/h/smx.txt 2>&1
for r in 1 2; do for v in E0 E11; do $V/$v/embd $v; done; done > $OUT/h/embd.txt 2>&1
cat $OUT/h/smx.txt $OUT/h/embd.txt
OUT=$OUT/check bash scripts/gpu_check.sh "python3 scripts/bench_ops.py --dtype fp16 > $OUT/bench_ops_fp16.md 2>&1; sed -n 12,24p $OUT/bench_ops_fp16.md | cut -c1-150" "python3 scripts/bench_ops.py --dtype bf16 > $OUT/bench_ops_bf16.md 2>&1; sed -n 12,24p $OUT/bench_ops_bf16.md | cut -c1-150"
