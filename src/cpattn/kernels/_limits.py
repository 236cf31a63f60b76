"""Hardware limits the kernels plan against (no triton import, so both kernel modules share it)."""

#: Bytes of shared memory one block may use on sm_90 (H100 / H200).
SM90_SMEM_PER_BLOCK = 232448
