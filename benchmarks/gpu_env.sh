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
