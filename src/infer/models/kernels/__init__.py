"""The decoder's Triton kernels and what chooses them: `routes.py` (which kernel serves which
call), `bundle.py` (the `Kernels` bundles), the kernels, their launch parameters (`*_tiles.py`)
and `arrivals.py`. Only the kernel modules import Triton."""
