#!/usr/bin/env bash
# The GPU device check (scripts/device_check.py) as the one command for the device tool. It runs on the GPU
# machine, from the repository root of the copy that travels there, writes its JSON files into $OUT as it goes
# (00_provenance ... 12_ranks, summary.json, measurements.json, children/) and exits non-zero unless everything
# planned ran and agreed with naive (summary.json names each failure). Phases and budgets: docs/device-check.md.
#
# 1. Before the call, on a CPU machine with the CuTe DSL (`. .venv/bin/activate`), after any kernel change:
#      python scripts/device_check.py --build-prebuilt prebuilt
#        (every kernel of kernels/toolchain/targets.py: the fused ops and the megakernel variants as TVM-FFI .so + cubin
#         + PTX, the DSL runtime shipped as libcute_dsl_runtime.so.xz, prebuilt/BUILD_INFO.json with the commit:
#         the copy on the GPU machine may have no .git)
#      python scripts/device_check.py --out /tmp/dc --dry-run --prebuilt prebuilt
#        (the whole plan on the CPU, GPU launches left out: every artefact verified and loaded, the carried size;
#         it must exit 0)
#    The GPU image has no apache-tvm-ffi, which loads the kernels: carry its Python 3.12 wheel, the version the
#    kernels were built with (prebuilt/ is ignored by .gitignore already):
#      echo /.whl/ >> .git/info/exclude
#      python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#        -d .whl apache-tvm-ffi==0.1.15.post2
#    Delete prebuilt/libcute_dsl_runtime.so if a local load unpacked it (the .xz travels); the dry run reports the
#    carried total (working tree + prebuilt + .whl), which must stay under 64 MiB.
# 2. The call (375 s planned, inside a 500-second window):
#      run(command="bash scripts/device_check.sh", carry=["prebuilt", ".whl"], timeout_s=560)
#    Add --quick (shorter budgets, fewer rows) when little device time is left.
#    Then give_back unless rerunning at once.
# 3. Afterwards: copy $OUT/measurements.json to data/measurements/<date>-h200.json and mark the rows of
#    data/measurements/gpu_outstanding.json that it covers (data/measurements/README.md).
#
# scripts/device_check.py itself installs nothing. This wrapper only unpacks the carried wheel into /tmp/site
# and puts it on PYTHONPATH (the device tool's documented way to bring a package), when one was carried.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/kimik3-device-check}"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
python3 scripts/device_check.py --out "$OUT" --prebuilt prebuilt "$@"
