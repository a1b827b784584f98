#!/usr/bin/env bash
# The test command: set up .venv (scripts/setup_env.sh), then
#   1. compile every CUDA source with plain nvcc -c (when nvcc is on PATH), so a
#      kernel that does not compile fails even on a machine without a GPU;
#   2. bash -n and shellcheck on every shell script;
#   3. every Python file parses (the GPU scripts and benchmarks included, which
#      no CPU test imports);
#   4. pytest, one pytest-xdist worker per core (GPU-marked tests are skipped without a GPU);
#      a test module's tests that share an expensive fixture form an xdist_group, run by one worker.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"` (`-n 0`: no workers).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup_env.sh
# shellcheck disable=SC1091
source .venv/bin/activate

if command -v nvcc > /dev/null && compgen -G "ls_fairseq/csrc/*.cu" > /dev/null; then
  obj=$(mktemp -d)
  for cu in ls_fairseq/csrc/*.cu; do
    nvcc -c -std=c++20 -O1 --expt-relaxed-constexpr -arch=sm_90 -Ils_fairseq/csrc "$cu" -o "$obj/$(basename "$cu").o" \
      || { echo "test: $cu does not compile" >&2; exit 1; }
  done
  echo "test: every CUDA source compiles with nvcc ($(find "$obj" -name '*.o' | wc -l) files)"
  rm -rf "$obj"
else
  echo "test: nvcc not found or no CUDA sources; CUDA compile check skipped"
fi

mapfile -t shell_scripts < <(git ls-files '*.sh' '.ci/run' 2>/dev/null || find . -name '*.sh' -not -path './.venv/*')
for s in "${shell_scripts[@]}"; do bash -n "$s"; done
shellcheck "${shell_scripts[@]}"
echo "test: bash -n and shellcheck pass on ${#shell_scripts[@]} shell scripts"

mapfile -t py_files < <(git ls-files '*.py' 2>/dev/null || find . -name '*.py' -not -path './.venv/*')
python - "${py_files[@]}" <<'PY'
import ast
import importlib
import sys

# every file parses, and every name it imports from ls_fairseq exists (also imports inside
# functions, which the GPU scripts and benchmarks only reach on a GPU)
missing = []
for path in sys.argv[1:]:
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "ls_fairseq":
            module = importlib.import_module(node.module)
            for alias in node.names:
                if alias.name != "_C" and not hasattr(module, alias.name):  # _C: built only with CUDA
                    try:
                        importlib.import_module(node.module + "." + alias.name)
                    except ImportError:
                        missing.append("{}:{}: {} has no {}".format(path, node.lineno, node.module, alias.name))
if missing:
    sys.exit("test: imports of names that do not exist:\n" + "\n".join(missing))
PY
echo "test: every Python file parses and imports only existing ls_fairseq names (${#py_files[@]} files)"

python -m pytest -q -p no:cacheprovider -n auto --dist loadgroup "$@" tests
