"""A build of layer_norm.cu for racecheck_strip.sh (a probe, not a kernel to ship), printed:
  asis     as it is;
  ownfold  the column sums' fold in its own shared buffer instead of the cp.async ring;
  rowsync  a block-wide __syncthreads per row instead of the pair's named barrier: every row group
           iterates to the longest group's count, a group past its strip's end computing on its
           empty ring slot but storing and adding nothing.
Usage: python3 variant.py asis|ownfold|rowsync layer_norm.cu > layer_norm_probe.cu"""
import sys

EDITS = {
    "asis": [],
    "ownfold": [
        ("  float(*fold)[C] = reinterpret_cast<float(*)[C]>(ring);\n",
         "  __shared__ float own[kWarps][C];\n  float(*fold)[C] = own;\n"),
    ],
    "rowsync": [
        ("  for (int j = 0, parity = 0; r < r1; ++j, r += kStripRows, parity ^= 1) {\n",
         "  const int iters = int((r1 - r0 + kStripRows - 1) / kStripRows);\n"
         "  for (int j = 0, parity = 0; j < iters; ++j, r += kStripRows, parity ^= 1) {\n"
         "    const bool live = r < r1;\n"),
        ("        acc[it][0][i] += d * xh[it][i];\n        acc[it][1][i] += d;\n",
         "        if (live) acc[it][0][i] += d * xh[it][i];\n        if (live) acc[it][1][i] += d;\n"),
        ("      row_group_barrier<SPLIT>(group);\n", "      __syncthreads();\n"),
        ("      store<T, V>(dx + e, o);\n", "      if (live) store<T, V>(dx + e, o);\n"),
        ("          acc[it][2][i] += o[i];\n", "          if (live) acc[it][2][i] += o[i];\n"),
        ("        store<T, V>(tail.dh + e, o);\n", "        if (live) store<T, V>(tail.dh + e, o);\n"),
    ],
}


def main():
    which, path = sys.argv[1], sys.argv[2]
    source = open(path).read()
    for old, new in EDITS[which]:
        if source.count(old) != 1:
            sys.exit("variant.py: {} no longer holds the line {!r} once: update the edit".format(path, old))
        source = source.replace(old, new)
    sys.stdout.write(source)


if __name__ == "__main__":
    main()
