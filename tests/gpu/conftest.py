"""GPU tests: NCCL, one rank per visible GPU. Run on a CUDA machine with `python3 -m pytest tests/gpu`.

On a machine without CUDA this folder is not collected at all (there is nothing here that a
CPU could check; the CPU suite covers the same engines over gloo).
"""

import torch

if not torch.cuda.is_available():
    collect_ignore_glob = ["*.py"]
