"""Kubernetes' rules for object names and labels, as the API server enforces them."""

from __future__ import annotations

import re
from collections.abc import Mapping
from functools import lru_cache

from stoker.ports.cluster import Invalid

# Object names are DNS-1123 subdomains; label names and values follow the label syntax.
_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?")


def check_name(kind: str, name: str) -> None:
    """`Invalid` unless `name` is a DNS-1123 subdomain."""
    if not name or len(name) > 253 or not _NAME.fullmatch(name):
        raise Invalid(f"{kind} name {name!r} is not a DNS-1123 subdomain", status=422)


def check_labels(labels: Mapping[str, str]) -> None:
    """`Invalid` unless every key and value follows the label syntax."""
    for key, value in labels.items():
        problem = _label_problem(key, value)
        if problem is not None:
            raise Invalid(problem, status=422)


# Cached: a simulated fleet creates the same label pairs on thousands of pods.
@lru_cache(maxsize=65536)
def _label_problem(key: str, value: str) -> str | None:
    prefix, _, name = key.rpartition("/")
    if "/" in key and (not prefix or len(prefix) > 253 or not _NAME.fullmatch(prefix)):
        return f"label key {key!r}: invalid prefix"
    if len(name) > 63 or not _LABEL_NAME.fullmatch(name):
        return f"label key {key!r}: invalid name"
    if len(value) > 63 or not _LABEL_VALUE.fullmatch(value):
        return f"label {key!r}: invalid value {value!r}"
    return None
