#!/usr/bin/env bash
# session 20 call 2: softmax forward launch shapes (p = 0 and a copy as floors) and embedding backward
# (chunk kernel reading only keep-bits; rows in flight) in harnesses; ncu kernel durations of the
# embedding backward; the embedding GPU tests on the working tree's build.
set -u
R=$PWD; K=$R/.device-kit/calls/s20; V=/tmp/v
mkdir -p $V $OUT
source .device-kit/bootstrap.sh > $OUT/bootstrap.log 2>&1
( TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=10 python3 setup.py build_ext --inplace > $OUT/build.log 2>&1; echo "build rc=$?" > $OUT/build.rc ) &
for v in S0 S3 S4 S5 S6 E0 E4 E5 E6 E7; do mkdir -p $V/$v; done
cp .device-kit/variants/main20/ls_fairseq/csrc/* $V/E0/
for v in S0 S3 S4 S5 S6 E4 E5 E6 E7; do cp ls_fairseq/csrc/* $V/$v/; done
sed -i 's/^constexpr int kThreads = 128;/constexpr int kThreads = 256;/' $V/S3/softmax.cu
sed -i 's/^constexpr int kThreads = 128;/constexpr int kThreads = 512;/' $V/S4/softmax.cu
sed -i 's|const float inv = sum > 0.f ? 1.f / sum : 0.f,|const float inv = sum > 0.f ? __fdividef(1.f, sum) : 0.f,|' $V/S5/softmax.cu
sed -i 's|if (tk <= 32) return launch.template operator()<ITEMS0, 32 / ITEMS0, CONTIG>(), true;|if (tk <= 32) return launch.template operator()<2 * ITEMS0, 16 / ITEMS0, CONTIG>(), true;|' $V/S6/softmax.cu
sed -i 's/constexpr int kRowsInFlight = 2;/constexpr int kRowsInFlight = 4;/; s/constexpr int kChunkBlocksPerSM = 8;/constexpr int kChunkBlocksPerSM = 6;/' $V/E5/embedding.cu
sed -i 's/constexpr int kRowsInFlight = 2;/constexpr int kRowsInFlight = 8;/; s/constexpr int kChunkBlocksPerSM = 8;/constexpr int kChunkBlocksPerSM = 4;/' $V/E6/embedding.cu
sed -i 's/constexpr int kJoinBlocks = 256;/constexpr int kJoinBlocks = 512;/' $V/E7/embedding.cu
for v in S3 S4 S5 S6 E5 E6 E7; do diff -q $V/$v ls_fairseq/csrc > /dev/null && echo "$v unchanged!"; done
for v in S0 S3 S4 S5 S6; do (cd $V/$v && nvcc -std=c++20 -O3 -arch=sm_90 --expt-relaxed-constexpr -I . $K/smx.cu -o smx > nvcc.log 2>&1 || echo "$v compile failed") & done
for v in E0 E4 E5 E6 E7; do (cd $V/$v && nvcc -std=c++20 -O3 -arch=sm_90 --expt-relaxed-constexpr -I . $K/embd.cu -o embd > nvcc.log 2>&1 || echo "$v compile failed") & done
wait
cat $OUT/build.rc
for r in 1 2; do for v in S0 S3 S4 S5 S6; do $V/$v/smx $v; done; done > $OUT/smx.txt 2>&1
for r in 1 2; do for v in E0 E4 E5 E6 E7; do $V/$v/embd $v; done; done > $OUT/embd.txt 2>&1
for v in E0 E4; do /usr/local/cuda/bin/ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum -s 9 -c 9 $V/$v/embd $v ncu > $OUT/ncu_$v.txt 2>&1; done
grep -E "^  [a-z_].*\(|gpu__time_duration" $OUT/ncu_E0.txt $OUT/ncu_E4.txt | sed 's/(int, int, int)x(int, int, int).*//' | cut -c1-140 > $OUT/ncu_short.txt
export PYTHONPATH=$R${PYTHONPATH:+:$PYTHONPATH}
python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_embedding.py > $OUT/pytest.log 2>&1; echo "pytest rc=$?"
tail -2 $OUT/pytest.log; grep -E "FAILED|Error" $OUT/pytest.log | head -10
cat $OUT/ncu_short.txt | head -60
cat $OUT/smx.txt; cat $OUT/embd.txt
