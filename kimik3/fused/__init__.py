"""The fused decode step apart from its stage: the plan (``plan``), what one launch costs (``launch_cost``), the
runners that execute it (``runners``) and where its compiled kernels come from (``loading``); stage ``fused``
(``kimik3/stages/fused.py``) puts them behind the Decoder. Design: docs/architecture.md (map)."""
