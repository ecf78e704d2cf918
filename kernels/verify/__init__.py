"""Host verification of the device code (never imported by shipped code). The host JIT gets its float -> bf16
conversion before any verification module imports the CuTe DSL (``host_runtime``)."""

from kimik3.kernels.verify.host_runtime import ensure_bf16_conversion

ensure_bf16_conversion()
