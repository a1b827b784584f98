#!/usr/bin/env bash
# session 20 call 1: softmax forward (keep-bits drawn while the loads are in flight) and embedding backward
# (keep-bits drawn beside the first sort; joins split by columns, 8 lanes) in harnesses against main;
# the extension built meanwhile, then the embedding and softmax GPU tests.
set -u
R=$PWD; K=$R/.device-kit/calls/s20; V=/tmp/v
mkdir -p $V $OUT
source .device-kit/bootstrap.sh > $OUT/bootstrap.log 2>&1
( TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=10 python3 setup.py build_ext --inplace > $OUT/build.log 2>&1; echo "build rc=$?" > $OUT/build.rc ) &
for v in S0 S1 S2 E0 E1 E2 E3 E4; do mkdir -p $V/$v; done
cp .device-kit/variants/main20/ls_fairseq/csrc/* $V/S0/; cp .device-kit/variants/main20/ls_fairseq/csrc/* $V/E0/
for v in S1 S2 E1 E2 E3 E4; do cp ls_fairseq/csrc/* $V/$v/; done
sed -i 's/^__global__ void softmax_forward_warp_kernel/__global__ void __launch_bounds__(128, (CONTIG \&\& ITEMS == 8) ? 16 : 1) softmax_forward_warp_kernel/' $V/S2/softmax.cu
sed -i 's/constexpr int kJoinLanes = 8;/constexpr int kJoinLanes = 2;/' $V/E2/embedding.cu
sed -i 's/const bool draw = rng \&\&/const bool draw = false \&\& rng \&\&/' $V/E3/embedding.cu
sed -i 's/constexpr int kJoinLanes = 8;/constexpr int kJoinLanes = 4;/' $V/E4/embedding.cu
grep -c "launch_bounds__(128" $V/S2/softmax.cu; grep -c "kJoinLanes = 2" $V/E2/embedding.cu; grep -c "draw = false" $V/E3/embedding.cu
for v in S0 S1 S2; do (cd $V/$v && nvcc -std=c++20 -O3 -arch=sm_90 --expt-relaxed-constexpr -Xptxas -v -I . $K/smx.cu -o smx > ptxas.log 2>&1 || echo "$v compile failed") & done
for v in E0 E1 E2 E3 E4; do (cd $V/$v && nvcc -std=c++20 -O3 -arch=sm_90 --expt-relaxed-constexpr -I . $K/embd.cu -o embd > nvcc.log 2>&1 || echo "$v compile failed") & done
wait
cat $OUT/build.rc
for v in S0 S1 S2; do grep -A1 "forward_warp_kernelI6__halfLi8ELi4ELb1" $V/$v/ptxas.log | grep -o "Used [0-9]* registers" | sed "s/^/$v /"; done
for r in 1 2; do for v in S0 S1 S2; do $V/$v/smx $v; done; done > $OUT/smx.txt 2>&1
for r in 1 2; do for v in E0 E1 E2 E3 E4; do $V/$v/embd $v; done; done > $OUT/embd.txt 2>&1
export PYTHONPATH=$R${PYTHONPATH:+:$PYTHONPATH}
python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_embedding.py tests/test_softmax.py > $OUT/pytest.log 2>&1; echo "pytest rc=$?"
tail -3 $OUT/pytest.log
grep -E "failed|FAILED|Error" $OUT/pytest.log | head -10
cat $OUT/smx.txt; cat $OUT/embd.txt
