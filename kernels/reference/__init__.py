"""Host-only test material of the fused kernels: per op (``<op>.py``) seeded random inputs (``make_inputs``,
outputs poisoned) and a plain fp32 PyTorch ``reference``; ``common.py`` holds the shared ``Rng`` and RMSNorm. No
kernel's source hash covers this room, so editing a test input invalidates no prebuilt kernel."""
