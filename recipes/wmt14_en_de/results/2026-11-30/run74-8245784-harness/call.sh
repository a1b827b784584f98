#!/usr/bin/env bash
# session 20 call 6: the embedding backward's keep-bits draw: bytes a thread (1, 2, 4) and where (a third
# beside the slice sort, or all), in the harness.
set -u
R=$PWD; K=$R/.device-kit/calls/s20; V=/tmp/v
mkdir -p $V $OUT
for v in E11 E12 E13 E14 E15; do mkdir -p $V/$v; cp ls_fairseq/csrc/* $V/$v/; done
sed -i 's/static constexpr int kBytes = 4, kMaxBlocks = 4096;/static constexpr int kBytes = 1, kMaxBlocks = 16384;/' $V/E12/embedding.cu $V/E14/embedding.cu
sed -i 's/static constexpr int kBytes = 4, kMaxBlocks = 4096;/static constexpr int kBytes = 2, kMaxBlocks = 16384;/' $V/E13/embedding.cu $V/E15/embedding.cu
sed -i 's|third = keep_bytes / 12 \* 4;|third = keep_bytes;|' $V/E14/embedding.cu $V/E15/embedding.cu
for v in E12 E13 E14 E15; do diff -q $V/$v ls_fairseq/csrc > /dev/null && echo "$v unchanged!"; done
grep -c "third = keep_bytes;" $V/E14/embedding.cu
for v in E11 E12 E13 E14 E15; do (cd $V/$v && nvcc -std=c++20 -O3 -arch=sm_90 --expt-relaxed-constexpr -I . $K/embd.cu -o embd > nvcc.log 2>&1 || echo "$v compile failed") & done
wait
for r in 1 2 3; do for v in E11 E12 E13 E14 E15; do $V/$v/embd $v; done; done > $OUT/embd.txt 2>&1
cat $OUT/embd.txt
