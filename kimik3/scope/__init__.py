"""Scope gates: what each fast path supports, declared as data, and every reason a request is refused
(docs/architecture.md §13). ``features`` reads a config's features (fail closed on anything unreviewed), ``spec``
the declaration and its refusals, ``gates`` the fast paths' declarations."""

from __future__ import annotations

from kimik3.scope.features import ABSENT, FEATURES, FIELD_ROLES, config_features, unreviewed
from kimik3.scope.spec import Request, Rule, ScopeSpec, request_of

__all__ = ["ABSENT", "FEATURES", "FIELD_ROLES", "Request", "Rule", "ScopeSpec", "config_features", "request_of",
           "unreviewed"]
