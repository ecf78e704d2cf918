"""CuTe DSL decode kernels for Kimi K3 (imported as ``kimik3.kernels``).

Modules: ``gemv`` (bf16 GEMV, fused RMSNorm, residual / fp32 epilogues, lm_head + arg-max), ``router``,
``kda``, ``mla_decode``, ``moe`` (bf16 and MXFP4 experts), ``attn_res``; ``registry`` (variants, budgets),
``build`` (compile + ptxas report + disk cache) and ``prebuilt`` (ahead-of-time export and verified
loading). Importing this package does not import the CuTe DSL; the kernel modules do. See README.md.
"""
