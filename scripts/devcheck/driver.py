"""The CUDA driver's view of a kernel, through cuda-python on the GPU machine (no CuTe DSL there): load the
cubin, read the function's attributes, set the launcher's carveout and dynamic shared memory, ask the occupancy of
one CTA per SM. docs/device-check.md."""

from __future__ import annotations

from typing import Any


def _driver() -> Any:
    try:
        from cuda.bindings import driver as cu  # cuda-python >= 12.6
    except ImportError:
        from cuda import cuda as cu  # older cuda-python
    return cu


def _ok(result: Any) -> Any:
    """cuda-python returns (error, values...): raise on an error, return the values."""
    cu = _driver()
    err, *vals = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        _, text = cu.cuGetErrorString(err)
        raise RuntimeError(f"CUDA driver: {err.name if hasattr(err, 'name') else err}: "
                           f"{text.decode() if isinstance(text, bytes) else text}")
    return vals[0] if len(vals) == 1 else vals


def driver_preflight(cubin: bytes, function: str, dynamic_shared: int, threads: int,
                     carveout_percent: int) -> dict[str, Any]:
    """The function's attributes as the driver loads them, and the occupancy of ``threads``-thread CTAs with
    ``dynamic_shared`` bytes under the launcher's carveout; the device's limits beside them."""
    import torch

    cu = _driver()
    torch.cuda.init()  # the primary context current on this thread: the module loads into it
    torch.zeros(1, device="cuda")
    dev = _ok(cu.cuDeviceGet(torch.cuda.current_device()))
    A, F = cu.CUdevice_attribute, cu.CUfunction_attribute

    def dattr(a: Any) -> int:
        return int(_ok(cu.cuDeviceGetAttribute(a, dev)))

    module = _ok(cu.cuModuleLoadData(cubin))
    try:
        fn = _ok(cu.cuModuleGetFunction(module, function.encode()))

        def fattr(a: Any) -> int:
            return int(_ok(cu.cuFuncGetAttribute(a, fn)))

        _ok(cu.cuFuncSetAttribute(fn, F.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, dynamic_shared))
        _ok(cu.cuFuncSetAttribute(fn, F.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, carveout_percent))
        blocks = int(_ok(cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(fn, threads, dynamic_shared)))
        return {
            "registers": fattr(F.CU_FUNC_ATTRIBUTE_NUM_REGS),
            "static_shared_bytes": fattr(F.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES),
            "local_bytes": fattr(F.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES),
            "max_threads_per_block": fattr(F.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK),
            "max_dynamic_shared_bytes": fattr(F.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES),
            "preferred_carveout_percent": fattr(F.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT),
            "blocks_per_sm": blocks,
            "sm_count": dattr(A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
            "cooperative_launch": bool(dattr(A.CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH)),
            "max_shared_per_sm": dattr(A.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR),
            "max_shared_per_block_optin": dattr(A.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN),
            "registers_per_sm": dattr(A.CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR),
            "l2_bytes": dattr(A.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE),
            "how": "cuda-python: cuModuleLoadData of the prebuilt cubin, cuFuncGetAttribute, "
                   "cuOccupancyMaxActiveBlocksPerMultiprocessor with the launcher's carveout and dynamic shared size",
        }
    finally:
        _ok(cu.cuModuleUnload(module))
