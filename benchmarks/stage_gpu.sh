#!/usr/bin/env bash
# What a lent GPU machine lacks for the GPU check, as wheels in .whl/ (ignored by git) to carry
# there: it runs Python 3.12 with CUDA torch, transformers, peft, accelerate, aiohttp, httpx,
# pyarrow, psutil, rich, pillow and pyyaml already, and reaches no package index. --quick needs
# none of these; the scaletrl row needs TRL and the datasets library (the versions of
# constraints.txt). See benchmarks/README.md for the command to run there.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
pins=()
for name in trl datasets dill multiprocess; do
    pins+=("$(grep -i "^${name}==" constraints.txt)")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "${pins[@]}"
du -sh .whl
