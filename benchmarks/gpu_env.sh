#!/usr/bin/env bash
# Environment for every GPU run: NVLink multicast off (it can take a shared host's GPUs down),
# overlapkit from this checkout, and the wheels of packages the GPU image may lack appended
# *after* the image's own site-packages (a .pth file), so the image's versions win.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ -d .whl ] && [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  echo /tmp/site > "$(python3 -c 'import site; print(site.getsitepackages()[0])')/zz_overlapkit_extra.pth"
fi

# step NAME SECONDS COMMAND... : run one measurement under its own time limit, log it to
# $out/logs/NAME.log and show its tail; a failing step is reported, never fatal, so a call
# always reaches its end and returns what it got.
step() {
  local name=$1 limit=$2; shift 2
  echo "=== $name ($(date +%T), limit ${limit}s)"
  timeout "$limit" "$@" > "$out/logs/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc"; tail -n 15 "$out/logs/$name.log"
}
