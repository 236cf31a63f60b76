"""Compile FA4's Hopper forward kernel without a GPU and write its PTX, cubin and SASS, to compare
its key loop with the dense sm90 kernel's (``tools/sass_loops.py``).

FA4 (``flash_attn.cute``) compiles for a chosen architecture on the CPU when the tensors are
``FakeTensorMode`` tensors and ``FLASH_ATTENTION_ARCH`` / ``CUTE_DSL_ARCH`` name it; CuTe DSL then
keeps the PTX and cubin in ``CUTE_DSL_DUMP_DIR`` (``CUTE_DSL_KEEP=ptx,cubin``). The call is the
kernel benchmark's fa4 varlen call for rank 0 of a zigzag point (two segments of ``S / 2C``
queries over one sequence of ``S`` keys, bottom-right causal), d128: 32 query / 8 KV heads.

Set-up on the CPU VM (the FA4 wheels are for Python 3.12):
    python3.12 -m venv /tmp/fa4v && /tmp/fa4v/bin/pip install torch==2.13.0 numpy einops
    mkdir /tmp/fa4site && /tmp/fa4v/bin/pip install --no-index --no-deps --target /tmp/fa4site \\
        ../shared/gpu/fa4/part1/*.whl
    cat ../shared/gpu/fa4/part1/cu13.tar.xz.aa ../shared/gpu/fa4/part2/cu13.tar.xz.a[bc] | tar xJ -C /tmp/fa4site
Run (cuobjdump from any triton wheel, e.g. the sm90_offline_check venv's):
    PYTHONPATH=/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages /tmp/fa4v/bin/python \\
        tools/fa4_offline_sass.py --out /tmp/fa4dump \
        --cuobjdump /tmp/t36/lib/python3.11/site-packages/triton/backends/nvidia/bin/cuobjdump
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess


def compile_varlen(seq: int, cp: int, head_dim: int = 128, heads: int = 32, kv_heads: int = 8) -> None:
    """FA4's varlen forward of rank 0's zigzag work, compiled only (fake tensors)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from flash_attn.cute import flash_attn_varlen_func

    chunk = seq // (2 * cp)
    with FakeTensorMode():
        q = torch.empty(2 * chunk, heads, head_dim, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(seq, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
        v = torch.empty(seq, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
        i32 = dict(dtype=torch.int32, device="cuda")
        flash_attn_varlen_func(q, k, v, cu_seqlens_q=torch.empty(3, **i32), cu_seqlens_k=torch.empty(3, **i32),
                               seqused_k=torch.empty(2, **i32), max_seqlen_q=chunk, max_seqlen_k=seq, causal=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for the PTX, cubin and SASS")
    p.add_argument("--seq", type=int, default=16384)
    p.add_argument("--cp", type=int, default=4)
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--sms", default="132")
    p.add_argument("--cuobjdump", default="cuobjdump")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    os.environ.update(FLASH_ATTENTION_ARCH=a.arch, CUTE_DSL_ARCH=f"{a.arch}a", FLASH_ATTENTION_NUM_SMS=a.sms,
                      CUTE_DSL_KEEP="ptx,cubin", CUTE_DSL_DUMP_DIR=os.path.abspath(a.out),
                      FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED="0")
    compile_varlen(a.seq, a.cp)
    for cubin in sorted(glob.glob(os.path.join(a.out, "*.cubin"))):
        sass = subprocess.run([a.cuobjdump, "-sass", cubin], capture_output=True, text=True, check=True).stdout
        path = cubin[: -len(".cubin")] + ".sass"
        with open(path, "w") as f:
            f.write(sass)
        print(f"{path}: {sass.count('HGMMA')} HGMMA, {sass.count('MUFU.EX2')} EX2")


if __name__ == "__main__":
    main()
