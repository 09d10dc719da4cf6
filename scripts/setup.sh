#!/usr/bin/env bash
# Create .venv and install the project with the exact torch build first, so that nothing
# later pulls a different (multi-GB CUDA) torch. Extra pip extras: EXTRAS=gpu,alfworld,
# virtualhome (comma-separated).
# TORCH_SPEC picks the build (default torch==2.13.0; PyPI's Linux wheel is the CUDA one);
# TORCH_INDEX, if set, is the index to take it from (e.g. PyTorch's CPU-only index).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
EXTRAS=${EXTRAS:+,$EXTRAS}

# --no-compile, then one compileall on every core at the end: pip compiles each package's
# bytecode on one core. (Not left to first import: where PYTHONDONTWRITEBYTECODE is set, every
# process would compile torch, transformers and prefect again.)
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --no-compile --upgrade "pip>=24"
.venv/bin/python -m pip install --quiet --no-compile "$TORCH_SPEC" ${TORCH_INDEX:+--index-url "$TORCH_INDEX"}
torch_pin="torch==$(.venv/bin/python -c 'import torch; print(torch.__version__.split("+")[0])')"
# DeepSpeed (dev and gpu extras) builds from source against the installed torch; without build
# isolation its build cannot fetch a second torch.
.venv/bin/python -m pip install --quiet --no-compile "setuptools>=77" wheel
.venv/bin/python -m pip install --quiet --no-compile --no-build-isolation -c constraints.txt -c <(echo "$torch_pin") deepspeed
# constraints.txt pins every transitive dependency to the versions CI was run with;
# the installed torch is pinned too, so no requirement can swap it.
.venv/bin/python -m pip install --quiet --no-compile -c constraints.txt -c <(echo "$torch_pin") -e ".[dev$EXTRAS]"
# Files that do not compile (templates, Python 2 leftovers) are skipped, as pip skips them.
.venv/bin/python -m compileall -q -j 0 "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null || true
# TextWorld 1.7.0 (extra alfworld) packs its wheel's platform tags into one line that pip check
# misreads as "not supported on this platform"; any other complaint fails the install.
if ! report=$(.venv/bin/python -m pip check 2>&1); then
  if grep -v '^textworld [0-9.]* is not supported on this platform' <<<"$report" | grep -q .; then
    echo "$report" >&2
    exit 1
  fi
fi
echo "$report"
