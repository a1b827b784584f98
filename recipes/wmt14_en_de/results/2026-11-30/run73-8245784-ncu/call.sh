#!/usr/bin/env bash
# session 20 call 5: ncu of the softmax forward (p = 0.1 and p = 0) and backward, and of the embedding
# backward's sorts with the keep-bits draw: where their time goes (pipes, stalls, instructions).
set -u
R=$PWD; K=$R/.device-kit/calls/s20; V=/tmp/v; NCU=/usr/local/cuda/bin/ncu
mkdir -p $V/H $OUT
cp ls_fairseq/csrc/* $V/H/
(cd $V/H && nvcc -std=c++20 -O3 -arch=sm_90 --expt-relaxed-constexpr -lineinfo -I . $K/smx.cu -o smx > nvcc_s.log 2>&1 || echo "smx compile failed") &
(cd $V/H && nvcc -std=c++20 -O3 -arch=sm_90 --expt-relaxed-constexpr -lineinfo -I . $K/embd.cu -o embd > nvcc_e.log 2>&1 || echo "embd compile failed") &
wait
SEC="--section SpeedOfLight --section ComputeWorkloadAnalysis --section InstructionStats --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats"
$NCU --clock-control none --cache-control none $SEC -k regex:softmax -s 8 -c 3 $V/H/smx H profile > $OUT/ncu_softmax.txt 2>&1
$NCU --clock-control none --cache-control none $SEC -k regex:"slice_sort|merge_rank|chunk_kernel" -s 6 -c 3 $V/H/embd H ncu > $OUT/ncu_emb_draw.txt 2>&1
$NCU --clock-control none --cache-control none --set full --import-source no -k regex:softmax_forward -s 8 -c 2 -o $OUT/softmax_fwd $V/H/smx H profile > /dev/null 2>&1
$NCU --import $OUT/softmax_fwd.ncu-rep --page source --csv --print-source sass > $OUT/softmax_fwd_sass.csv 2>/dev/null; ls -la $OUT
for f in $OUT/ncu_softmax.txt $OUT/ncu_emb_draw.txt; do grep -E "^  [a-z_].*\(|Duration|Executed Ipc A|Issue Slots Busy|Executed Instructions  |Registers Per|Achieved Occupancy|No Eligible|Memory Throughput|Compute \(SM\) Th|Warp Cycles Per Issued|Stall|One or More Eligible" $f | sed 's/(int, int, int)x(int, int, int).*//' | cut -c1-120; done
