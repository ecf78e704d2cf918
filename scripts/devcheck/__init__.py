"""The GPU device check (``scripts/device_check.py``) in rooms: the plan, the phases, the child processes every
megakernel launch runs in, the preflight, the verdict and the report. Tooling, not the product: nothing in
``kimik3/`` imports it. Design: docs/device-check.md."""
