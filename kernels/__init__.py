"""CuTe DSL decode kernels for Kimi K3 (imported as ``kimik3.kernels``).

Modules: ``gemv`` (bf16 GEMV, fused RMSNorm, residual / fp32 epilogues, lm_head + arg-max), ``router``,
``kda``, ``mla_decode``, ``moe`` (bf16 and MXFP4 experts), ``attn_res``; ``registry`` (variants, budgets),
``build`` (compile + ptxas report + disk cache), ``prebuilt`` (ahead-of-time export and verified
loading) and ``host_exec`` (the kernels' device helpers executed on the host); ``meta`` and ``isa``, the
host-visible contracts (kernel metadata, the megakernel's instruction encoding), standard library only.
Importing this package does not import the CuTe DSL; the kernel modules
do. See README.md.
"""
