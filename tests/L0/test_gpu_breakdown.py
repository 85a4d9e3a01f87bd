"""The suite's kernel-time breakdown (``benchmarks/gpu_breakdown.py``) sorts real kernel names
into its categories (names as CUDA profiles of flash-attn, PyTorch, cuDNN, FA4, NCCL and the
package's own kernels show them)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

gpu_breakdown = pytest.importorskip("gpu_breakdown")

NAMES = {
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>(Flash_fwd_params)": "attention",
    "void flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<...>(flash::Flash_bwd_params)": "attention",
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x128x128_4x1x1": "attention",
    "kernel_cutlass_kernel_flash_attncuteflash_fwd_sm90FlashAttentionForwardSm90": "attention",
    "Memcpy DtoD (Device -> Device)": "transfers",
    "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)": "transfers",
    "void merge_partial_kernel<__nv_bfloat16, 4>(...)": "merges",
    "void at::native::vectorized_elementwise_kernel<4, at::native::lerp_kernel_tensor_weight(...)": "merges",
    "void gather_rows_kernel<float4>(...)": "copies",
    "void index_add_rows_kernel<float, __nv_bfloat16>(...)": "copies",
    "void at::native::(anonymous namespace)::CatArrayBatchedCopy<...>": "copies",
    "void at::native::elementwise_kernel<128, 2, at::native::direct_copy_kernel_cuda(...)": "copies",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MaxOps<float>>>": "other",
}


def test_kernel_names_sorted():
    for name, want in NAMES.items():
        assert gpu_breakdown.category(name) == want, name
    got = gpu_breakdown.sort_kernels([(n, 2.0) for n in NAMES])
    assert got["attention"] == {"us": 8.0, "calls": 4} and got["other"]["calls"] == 1
