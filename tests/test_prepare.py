"""recipes/wmt14_en_de/prepare.sh: the dictionary padded to a multiple of 16, so that --ls-fp8's vocabulary
GEMM (N = the dictionary's size) fits the FP8 GEMM."""
import gzip
import os
import sys

import pytest
from conftest import REPO, run
from fairseq.data import Dictionary


@pytest.mark.parametrize("padding", [None, "8"])
def test_dictionary_is_padded_to_a_multiple_of_16(tmp_path, padding):
    src = tmp_path / "text"
    src.mkdir()
    for split, n in {"train": 1500, "valid": 50, "test": 50}.items():
        for lang in ("en", "de"):
            with gzip.open(os.path.join(REPO, "data", "lohelp", "{}.{}.gz".format(split, lang)), "rt", encoding="utf-8") as f:
                (src / "{}.{}".format(split, lang)).write_text("".join(next(f) for _ in range(n)), encoding="utf-8")
    work = tmp_path / "work"
    # 500 pieces and fairseq's 4 specials: 504 types, a multiple of 8 but not of 16
    proc = run(["bash", os.path.join(REPO, "recipes", "wmt14_en_de", "prepare.sh"), "--from", str(src), "--work",
                str(work), "--vocab-size", "500", "--ratio", "2.5"] + (["--padding-factor", padding] if padding else []),
               env={"PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"], "PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stderr[-3000:]
    size = len(Dictionary.load(str(work / "data-bin" / "dict.en.txt")))
    assert size == (512 if padding is None else 504)
