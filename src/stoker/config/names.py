"""Kubernetes names and quantities, checked at start-up.

A bad name is a config error that names the key, not a pod the API server refuses on every
spawn. Each rule is a plain check (`is_label_value`) and an annotated string type the
config's models use (`LabelValue`, `QualifiedName`, `DnsSubdomain`, `DnsLabel`, `EnvName`,
`Quantity`), and the text a worker is handed (`WorkerText`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, StringConstraints, WithJsonSchema

#: Pool names appear in URLs, metric labels and process labels: keep them plain.
PoolName = Annotated[
    str, StringConstraints(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
]
#: Bearer tokens travel in an HTTP header: visible ASCII, long enough not to be guessed.
Token = Annotated[str, StringConstraints(min_length=16, max_length=512, pattern=r"^[\x21-\x7e]+$")]
OrgName = Annotated[str, StringConstraints(min_length=1, max_length=128)]

# A label value and the name part of a label or annotation key follow the same rule.
_LABEL_VALUE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?")
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_ENV_NAME = re.compile(r"[-._A-Za-z][-._A-Za-z0-9]*")
_QUANTITY = re.compile(r"(\d+(\.\d*)?|\.\d+)([mkMGTPE]|[KMGTPE]i|[eE]\d+)?")
#: What a label value may be, in words (fleet, pool names, label values).
LABEL_VALUE_RULE = (
    "a valid Kubernetes label value: at most 63 letters, digits, '-', '_' or '.', "
    "beginning and ending with a letter or digit"
)
#: What an object name (a lease, a priority class, a service account) may be, in words.
DNS_SUBDOMAIN_RULE = (
    "a valid Kubernetes object name: at most 253 lowercase letters, digits, '-' or '.', "
    "beginning and ending with a letter or digit"
)
_QUALIFIED_NAME_RULE = (
    "a valid Kubernetes key: an optional DNS prefix and '/', then at most 63 letters, "
    "digits, '-', '_' or '.', beginning and ending with a letter or digit"
)
_DNS_LABEL_RULE = (
    "a valid namespace: at most 63 lowercase letters, digits or '-', beginning and ending "
    "with a letter or digit"
)
_ENV_NAME_RULE = (
    "a valid environment variable name: letters, digits, '_', '-' or '.', not beginning "
    "with a digit"
)


def is_label_value(value: str) -> bool:
    """True when `value` is a non-empty Kubernetes label value."""
    return _LABEL_VALUE.fullmatch(value) is not None


def is_dns_subdomain(value: str) -> bool:
    """True when `value` is a Kubernetes object name (a DNS subdomain)."""
    return len(value) <= 253 and _DNS_SUBDOMAIN.fullmatch(value) is not None


def _is_qualified_name(value: str) -> bool:
    # A label or annotation key: an optional DNS-subdomain prefix and `/`, then a name.
    prefix, slash, name = value.rpartition("/")
    return (not slash or is_dns_subdomain(prefix)) and is_label_value(name)


def _rule(holds: Callable[[str], bool], rule: str) -> AfterValidator:
    """A validator that lets `value` through when it `holds`, else says it is not `rule`."""

    def check(value: str) -> str:
        if not holds(value):
            raise ValueError(f"{value!r} is not {rule}")
        return value

    return AfterValidator(check)


def _quantity_text(value: Any) -> Any:
    # YAML reads `cpu: 2` as a number; Kubernetes quantities are strings. Written out in
    # full: `format(.., "g")` would turn 4294967296 into 4.29497e+09.
    if isinstance(value, bool) or not isinstance(value, int | float):
        return value
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _check_quantity(value: str) -> str:
    match = _QUANTITY.fullmatch(value)
    if match is None:
        raise ValueError(f"{value!r} is not a Kubernetes quantity such as 500m, 2, 512Mi or 4Gi")
    if float(match.group(1)) <= 0:
        raise ValueError(f"{value!r} must be more than 0")
    return value


#: A label value; empty is valid in Kubernetes and means "no value" in a selector.
LabelValue = Annotated[str, _rule(lambda v: not v or is_label_value(v), LABEL_VALUE_RULE)]
#: A label or annotation key.
QualifiedName = Annotated[str, _rule(_is_qualified_name, _QUALIFIED_NAME_RULE)]
DnsSubdomain = Annotated[str, _rule(is_dns_subdomain, DNS_SUBDOMAIN_RULE)]
DnsLabel = Annotated[str, _rule(lambda v: _DNS_LABEL.fullmatch(v) is not None, _DNS_LABEL_RULE)]
EnvName = Annotated[
    str,
    _rule(lambda v: _ENV_NAME.fullmatch(v) is not None, _ENV_NAME_RULE),
    WithJsonSchema({"type": "string", "pattern": f"^{_ENV_NAME.pattern}$"}),
]
#: A Kubernetes resource quantity (`"2"`, `500m`, `4Gi`); numbers are accepted as text.
Quantity = Annotated[str, BeforeValidator(_quantity_text), AfterValidator(_check_quantity)]


def _worker_text(value: str) -> str:
    # exec refuses a NUL in an argument, a variable or a path, and text that is not valid
    # unicode (a lone surrogate) cannot be encoded for the process, the store or the pod.
    if "\x00" in value:
        raise ValueError("must not contain a NUL character")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid unicode (no lone surrogates)") from None
    return value


#: Text handed to a worker (an argument, an environment value, a path): what exec takes.
WorkerText = Annotated[str, AfterValidator(_worker_text)]


def _image(value: str) -> str:
    # The API server refuses an image with leading or trailing whitespace.
    if value != value.strip():
        raise ValueError(f"{value!r} must not begin or end with whitespace")
    return value


#: A container image reference: `NonEmptyWorkerText` without surrounding whitespace.
Image = Annotated[
    str, StringConstraints(min_length=1), AfterValidator(_worker_text), AfterValidator(_image)
]
#: `WorkerText` that is not empty (a program, an argument that must name something).
NonEmptyWorkerText = Annotated[str, StringConstraints(min_length=1), AfterValidator(_worker_text)]
