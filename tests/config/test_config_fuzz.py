"""The config file and its `STOKER_*` overrides, fed generated bad input: whatever the input,
`load_config` loads a config that the server can go on with, or raises `ConfigError` whose
lines name the key to change; never another exception, never a traceback, never a secret.

The documents start from the configs stoker ships (`examples/`, `deploy/`, the embedded
defaults), each also with every key spelled out, so that the nested sections of a pool
(`demand`, `cost`, `rollout`, `timeouts`, `spawn_backoff`) are there to be broken. Secrets
are planted in each: tokens, the activation key, a store password. A mutation replaces the
value at any key path, adds an unknown key at any level or deletes a key; overrides set
any key path from the environment.

`STOKER_CONFIG_FUZZ_EXAMPLES` sets the number of generated documents (the override and
`config check` tests run a fraction of it).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import itertools
import json
import math
import os
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stoker.adapters._rows import dump_json
from stoker.api.server import check_exposure
from stoker.api.tokens import TokenTable
from stoker.bootstrap import check_extras
from stoker.cli import main
from stoker.config import StokerConfig, load_config, plane_settings, to_domain
from stoker.config.problems import dotted
from stoker.domain.errors import ConfigError
from stoker.domain.pools import seed_settings, spec_from_json, template_from_json, template_json

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = (
    "examples/local.yaml",
    "examples/kubernetes.yaml",
    "examples/replicas.yaml",
    "deploy/kubernetes/base/stoker.yaml",
    "deploy/replicas/stoker.yaml",
)
EXAMPLES_RUN = int(os.environ.get("STOKER_CONFIG_FUZZ_EXAMPLES", "800"))

#: Planted in every base document: none of them may ever appear in an error.
ADMIN_TOKEN = "admin-Secret-Q7fx3L9pZk2w"
ORG_TOKEN = "org-Secret-Vb8nR4tW1yHsq"
STORE_PASSWORD = "pw-Secret-Jm5cX0qEr"
ACTIVATION_KEY = "activation-Secret-" + "Hq4t" * 6
SECRETS = (ADMIN_TOKEN, ORG_TOKEN, STORE_PASSWORD, ACTIVATION_KEY)

#: Sections of a pool spelled out in the every-key documents (`cost` has no default).
COSTS = ({"per_worker_hour": 0.5}, {"per_cpu_hour": 0.04, "per_gib_hour": 0.005})
#: A pod's keys filled in, so that their items are there to be broken too.
POD_EXTRAS = {
    "env": {"MODE": "warm"},
    "node_selector": {"pool": "workers"},
    "labels": {"team": "data"},
    "annotations": {"note": "fuzz"},
    "tolerations": [
        {
            "key": "workers",
            "operator": "Equal",
            "value": "yes",
            "effect": "NoExecute",
            "tolerationSeconds": 30,
        },
        {"operator": "Exists", "effect": "NoSchedule"},
    ],
}
#: Settings of a local process: with pods they are errors, so a pod pool's dump drops them.
LOCAL_ONLY = ("env", "cwd", "memory_mb")


def _with_secrets(doc: dict[str, Any]) -> dict[str, Any]:
    """`doc` with the secrets planted: tokens, the activation key, a store password."""
    doc = copy.deepcopy(doc)
    api = doc.setdefault("api", {})
    api["admin_tokens"] = [ADMIN_TOKEN]
    api["org_tokens"] = {ORG_TOKEN: "acme"}
    doc.setdefault("activation", {})["key"] = ACTIVATION_KEY
    store = doc.get("store", "")
    if store.startswith("postgresql://"):
        user, _, host = store[len("postgresql://") :].partition("@")
        doc["store"] = f"postgresql://{user}:{STORE_PASSWORD}@{host}"
    return doc


def _every_key(doc: dict[str, Any]) -> dict[str, Any]:
    """`doc` with every key spelled out: the effective config it loads to, pools with a
    cost and pods with every list and mapping filled in."""
    dumped = load_config_of(doc).model_dump(mode="json", by_alias=True, warnings=False)
    for i, pool in enumerate(dumped["pools"]):
        pool["cost"] = COSTS[i % len(COSTS)]
        if pool["pod"] is not None:
            for key in LOCAL_ONLY:
                del pool[key]
            pool["pod"].update(copy.deepcopy(POD_EXTRAS))
        else:
            pool["env"] = {"MODE": "warm"}
            pool["cwd"] = "."
    if dumped["runtime"]["kind"] == "kubernetes":
        dumped["runtime"]["placeholder_size"] = {"cpu": "2", "memory": "4Gi"}
    return _with_secrets(dumped)


def write_doc(tmp_path: Path, doc: dict[str, Any]) -> Path:
    """`doc` written as the config file `stoker.yaml` in `tmp_path`."""
    path = tmp_path / "stoker.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False, allow_unicode=True), encoding="utf-8")
    return path


def load_config_of(doc: dict[str, Any]) -> StokerConfig:
    """The config `doc` loads to (through a file, as `stoker serve` reads it)."""
    with tempfile.TemporaryDirectory() as directory:
        return load_config(write_doc(Path(directory), doc), {}).config


def _bases() -> list[tuple[str, dict[str, Any]]]:
    raw: dict[str, dict[str, Any]] = {"defaults": {}}
    for name in EXAMPLES:
        raw[name] = yaml.safe_load((ROOT / name).read_text(encoding="utf-8"))
    bases = []
    for name, doc in raw.items():
        bases.append((name, _with_secrets(doc)))
        bases.append((f"{name} (every key)", _every_key(doc)))
    return bases


BASES = _bases()


def key_paths(value: Any, at: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every key path of a document, depth first (list items by index)."""
    if isinstance(value, dict):
        items: Any = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return
    for key, child in items:
        yield (*at, key)
        yield from key_paths(child, (*at, key))


def as_written(doc: Any, path: tuple[Any, ...]) -> str:
    """A key path as an error names it: `pools[0].env.MODE`, a key YAML reads as another
    type as the file spells it (`api.true`), a key with a line break quoted."""
    parts: list[Any] = []
    for key in path:
        if isinstance(doc, dict) and not isinstance(key, str):
            parts.append(json.dumps(key))
        elif isinstance(key, str) and not key.isprintable():
            parts.append(repr(key))
        else:
            parts.append(key)
        doc = doc[key] if isinstance(doc, dict | list) and key in _keys(doc) else None
    return dotted(tuple(parts))


def _keys(doc: dict[Any, Any] | list[Any]) -> Any:
    return doc.keys() if isinstance(doc, dict) else range(len(doc))


def _get(doc: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        doc = doc[key]
    return doc


# -- generated values -----------------------------------------------------------------------

ODD_TEXT = [
    "",
    " ",
    "x" * 5000,
    "ünïcödé",
    "\u202e\u200b",
    "🔥",
    "{port}",
    "sqlite:///",
    "postgresql://",
    "mysql://x",
    "0.0.0.0",
    "-1",
    "nan",
    "inf",
    "1e309",
    "true",
    "null",
    "~",
    "Exists",
    "kubernetes",
    "local",
    "store",
    "canary",
    "replace",
    "paying",
    "/",
    ".",
    "../../etc/passwd",
    "a" * 64,
    "Equal",
    "NoExecute",
]
ODD_NUMBERS = [
    0,
    -1,
    1,
    2**31,
    2**63,
    10**30,
    -(10**30),
    0.5,
    -0.0,
    1e-308,
    1e308,
    math.nan,
    math.inf,
    -math.inf,
    0.9999,
    0.99999,
    100,
    101,
    86401,
    365 * 86400 + 1,
]
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from(ODD_NUMBERS),
    st.integers(),
    st.floats(),
    st.sampled_from(ODD_TEXT),
    st.text(max_size=12),
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=6,
)
unknown_keys = st.one_of(
    st.sampled_from(["kind", "name", "extra", "demand", "quantile", "cost", "pod", "x.y", "[0]"]),
    st.text(min_size=1, max_size=12),
    st.integers(-2, 5),
    st.booleans(),
)


@dataclass(frozen=True)
class Case:
    """A generated document, the overrides it is loaded with and what was done to it."""

    base: str
    doc: dict[str, Any]
    env: dict[str, str]
    steps: tuple[str, ...]


@st.composite
def mutated(draw: st.DrawFn, *, env_only: bool = False) -> Case:
    """A base document with 1-3 mutations of the file, and overrides of the environment."""
    base, doc = draw(st.sampled_from(BASES))
    doc = copy.deepcopy(doc)
    steps: list[str] = []
    for _ in range(0 if env_only else draw(st.integers(1, 3))):
        paths = list(key_paths(doc))
        kind = draw(st.sampled_from(["replace", "replace", "replace", "add", "delete"]))
        if kind == "add":
            where = draw(st.sampled_from([(), *(p for p in paths if _is_mapping(doc, p))]))
            key = draw(unknown_keys)
            _get(doc, where)[key] = draw(values)
            steps.append(f"add {dotted((*where, key))!r}")
            continue
        if not paths:
            continue
        path = draw(st.sampled_from(paths))
        parent = _get(doc, path[:-1])
        if kind == "delete":
            del parent[path[-1]]
            steps.append(f"delete {dotted(path)}")
        else:
            parent[path[-1]] = draw(values)
            steps.append(f"replace {dotted(path)} with {parent[path[-1]]!r:.80}")
    env = draw(overrides(doc)) if env_only or draw(st.integers(0, 3)) == 0 else {}
    return Case(base, doc, env, tuple(steps))


def _is_mapping(doc: dict[str, Any], path: tuple[Any, ...]) -> bool:
    return isinstance(_get(doc, path), dict)


#: Text an override's value may be: numbers, JSON (broken or not), odd strings.
override_text = st.one_of(
    st.sampled_from(ODD_TEXT),
    st.sampled_from(["[", "{", "[1,", '{"a":', "[]", "{}", "[null]", '{"kind": 1}', "NaN"]),
    st.text(max_size=12),
    values.map(lambda v: json.dumps(v)),
    st.integers().map(str),
    st.floats().map(str),
)


@st.composite
def overrides(draw: st.DrawFn, doc: dict[str, Any]) -> dict[str, str]:
    """1-3 `STOKER_*` variables, each setting a key path of `doc` (or one past it)."""
    # A variable names keys and indexes; tokens are org_tokens' keys, never variable names.
    paths = [
        p
        for p in key_paths(doc)
        if all(isinstance(k, str | int) and not isinstance(k, bool) for k in p)
        and "org_tokens" not in p[:-1]
    ]
    env: dict[str, str] = {}
    for _ in range(draw(st.integers(1, 3))):
        path = list(draw(st.sampled_from(paths))) if paths else ["store"]
        shape = draw(st.sampled_from(["as is", "as is", "as is", "deeper", "past the list"]))
        if shape == "deeper":
            path.append(draw(st.sampled_from(["quantile", "0", "kind", "x"]) | st.text(max_size=3)))
        elif shape == "past the list":
            path = [*path[:1], "7", *path[1:]]
        name = "STOKER_" + "__".join(str(k).upper() for k in path)
        env[name] = draw(override_text)
    return env


# -- what a message must be -----------------------------------------------------------------


def secrets_in(case: Case) -> set[str]:
    """The planted secrets still in the document or the overrides; and any long value a
    mutation or override set where a secret belongs (and nowhere else)."""
    found = {s for s in SECRETS if s in repr(case.doc) or s in repr(case.env)}
    public: set[str] = set()
    for path in key_paths(case.doc):
        value = _get(case.doc, path)
        if path[:2] == ("api", "org_tokens") and len(path) == 3:
            # `{token: org}`: the key is the token.
            found.add(str(path[2]))
            public.add(str(value))
        elif path[:2] == ("api", "org_tokens") and path[-1] == "token":
            found.add(str(value))  # The list form, `{org, token}`.
        elif path[:2] == ("api", "admin_tokens") and len(path) == 3:
            found.add(str(value))
        elif path != ("activation", "key") and isinstance(value, str):
            public.add(value)
    for name, value in case.env.items():
        if SECRET_VARIABLE.fullmatch(name):
            found.add(value)
        else:
            public.add(value)
    return {s for s in found - public if len(s) >= 12 and s.strip()}


#: Variables whose values are secrets: the API's tokens and the activation key.
SECRET_VARIABLE = re.compile(r"STOKER_API__(ADMIN|ORG)_TOKENS(__.*)?|STOKER_ACTIVATION__KEY")


#: The problem of a key YAML read as a number or a boolean (it names the file's key).
KEY_NOT_TEXT = "a key must be a string"

#: What a line of a traceback, or of pydantic's own rendering of an error, looks like.
NOT_OURS = re.compile(r"Traceback|File \"|errors\.pydantic\.dev|validation errors? for |\bat 0x")


def assert_config_error(case: Case, exc: ConfigError, file: Path) -> None:
    """One `config error: <where>: <problem>` line per problem, naming a key of the config,
    the file or the variable; no traceback text, no secret. A key an override set is
    followed by `(from <variable>)`, and one the file holds (and no override set) by
    `(from <file>)`."""
    message = str(exc)
    lines = message.splitlines()
    assert lines, case
    for line in lines:
        assert line.startswith("config error: "), (case, message)
        where, sep, problem = line[len("config error: ") :].partition(": ")
        assert sep and problem.strip(), (case, line)
        # A line of a token file is named after the key that names the file.
        where = re.sub(r"^(api\.(admin|org)_tokens_file) \(.*\) line \d+$", r"\1", where)
        assert names_a_key(where, case, file), (case, line)
        # A rollout's problems are named by their own keys (`pools[0].rollout.steps[1]`):
        # the section itself only when it is not a mapping.
        if re.fullmatch(r"pools\[\d+\]\.rollout", where):
            assert problem.startswith("must be a mapping"), (case, line)
        # A key the file wrote as a number is the file's fault, though an override may
        # name the same path as text (`0:` in the file, `STOKER_ACTIVATION__0`).
        if problem.startswith(KEY_NOT_TEXT):
            assert line.endswith(f" (from {file})"), (case, line)
        elif overridden(where, case):
            assert re.search(r" \(from .*STOKER_.+\)$", line), (case, line)
        elif where in {as_written(case.doc, p) for p in key_paths(case.doc)}:
            assert line.endswith(f" (from {file})"), (case, line)
    assert not NOT_OURS.search(message), (case, message)
    for secret in secrets_in(case):
        assert secret not in message, (case, message)


def names_a_key(where: str, case: Case, file: Path) -> bool:
    """True when `where` is a key of the config (by the schema or in the document), the file,
    or a variable of the overrides."""
    variables = {n if n.isprintable() else repr(n) for n in case.env}
    if where in variables or where.startswith(str(file)) or where == "(top level)":
        return True
    if where in {as_written(case.doc, p) for p in key_paths(case.doc)}:
        return True
    # A key an override set, made on its way (`STOKER_API__PROT__X` makes `api.prot`), or
    # holds in its JSON value.
    if overridden(where, case):
        return True
    shape = re.sub(r"\[\d+\]", "[]", where)
    return shape in SCHEMA_KEYS or any(shape.startswith(m + ".") for m in SCHEMA_MAPPINGS)


def overridden(where: str, case: Case) -> bool:
    """True when `where` is a key an override set, made or holds in its value."""
    # An override makes the mapping on its way where the file holds none, or null.
    in_file = {
        as_written(case.doc, p) for p in key_paths(case.doc) if _get(case.doc, p) is not None
    }
    for name in case.env:
        path: tuple[Any, ...] = tuple(name[len("STOKER_") :].lower().split("__"))
        if path[0] not in StokerConfig.model_fields or not all(path):
            continue  # Not a config key (`STOKER_URL` is the client's): not read.
        # A number is a list's index or a mapping's key: each is named its own way.
        for spelled in itertools.product(*[(k, int(k)) if k.isdecimal() else (k,) for k in path]):
            for n in range(1, len(spelled) + 1):
                at = as_written({}, spelled[:n])
                if n < len(spelled):
                    if where == at and at not in in_file:
                        return True
                elif where == at or where.startswith((at + ".", at + "[")):
                    return True
    return False


def _schema_keys() -> tuple[set[str], set[str]]:
    """The key paths of the schema (`[]` for any list item) and those holding free-form
    mappings (a pod's labels, a pool's env), from every base document's dotted paths."""
    keys: set[str] = set()
    for _, doc in BASES:
        for path in key_paths(doc):
            keys.add(re.sub(r"\[\d+\]", "[]", dotted(path)))
    mappings = {
        k
        for k in keys
        if k.rsplit(".", 1)[-1] in ("env", "labels", "annotations", "node_selector", "org_tokens")
    }
    return keys, mappings


SCHEMA_KEYS, SCHEMA_MAPPINGS = _schema_keys()


def after_loading(config: Any) -> None:
    """What `stoker serve` and `stoker config check` do with a loaded config before any
    I/O but a token file: the checks, the domain objects, each pool as the store seeds it
    and reads it back, and the derived names."""
    # No setting is NaN or infinite (nested sections included): no bound would hold.
    dumped = config.model_dump(mode="python", warnings=False)
    for path in key_paths(dumped):
        value = _get(dumped, path)
        assert not isinstance(value, float) or math.isfinite(value), dotted(path)
    check_exposure(config.api)
    TokenTable(config.api)
    check_extras(config)
    domain = to_domain(config)
    assert plane_settings(config) == domain.settings
    for spec in domain.pools:
        seed = json.loads(dump_json(seed_settings(spec, domain.strategies[spec.name])))
        template = template_from_json(json.loads(dump_json(template_json(spec.template))))
        assert spec_from_json(spec.name, seed, template, spec.revision) == spec
    config.fleet_name()
    config.janitor_lease_name()
    config.store_display()


def load_or_say_why(case: Case, tmp_path: Path) -> None:
    """The property: loads and the server can go on, or `ConfigError` saying why."""
    path = write_doc(tmp_path, case.doc)
    # YAML may read back another document than was written (a NEL in a key is a space).
    case = dataclasses.replace(case, doc=yaml.safe_load(path.read_text(encoding="utf-8")))
    try:
        loaded = load_config(path, case.env)
    except ConfigError as exc:
        assert_config_error(case, exc, path)
        return
    try:
        # As `serve` and `config check` run the checks: naming where the key was set.
        with loaded.checking():
            after_loading(loaded.config)
    except ConfigError as exc:
        assert_config_error(case, exc, path)


FUZZ = settings(
    max_examples=EXAMPLES_RUN,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


# -- the tests --------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "doc"), BASES, ids=[name for name, _ in BASES])
def test_every_base_document_loads(name: str, doc: dict[str, Any], tmp_path: Path) -> None:
    # A base that did not load would make every mutation of it an error for the wrong reason.
    loaded = load_config(write_doc(tmp_path, doc), {})
    after_loading(loaded.config)


def test_the_mutations_reach_every_nested_section_of_a_pool() -> None:
    reachable = {dotted(p) for _, doc in BASES for p in key_paths(doc)}
    for path in (
        "pools[0].demand.quantile",
        "pools[0].demand.miss_hold_s",
        "pools[0].demand.headroom_hold_s",
        "pools[0].demand.headroom",
        "pools[0].demand.stable_window_s",
        "pools[0].cost.per_worker_hour",
        "pools[1].cost.per_cpu_hour",
        "pools[0].rollout.steps",
        "pools[0].rollout.max_failure_ratio",
        "pools[0].timeouts.pending_s",
        "pools[0].spawn_backoff.factor",
        "pools[0].pod.tolerations[0].tolerationSeconds",
        "pools[0].pod.port",
        "pools[0].headroom_nodes",
        "runtime.placeholder_size.cpu",
        "leader_election.renew_deadline_s",
        "store_options.schema",
        "intervals.spawn_burst",
        "tracing.sample_ratio",
        "activation.key",
        "api.admin_tokens[0]",
        "orgs[0].min_hot_idle",
    ):
        assert path in reachable, path


@FUZZ
@given(case=mutated())
def test_a_mutated_config_loads_or_names_the_key(case: Case, tmp_path: Path) -> None:
    load_or_say_why(case, tmp_path)


def test_a_numeric_key_in_the_file_is_named_though_an_override_names_its_path(
    tmp_path: Path,
) -> None:
    # Found by the fuzz in CI: the file's `0:` key, and an override of `activation.0`.
    doc = {"activation": {"key": "activation-Secret-Hq4tHq4tHq4tHq4tHq4tHq4t", 0: None}}
    case = Case("defaults", doc, {"STOKER_ACTIVATION__0": ""}, ("add 'activation[0]'",))
    load_or_say_why(case, tmp_path)


@settings(FUZZ, max_examples=max(1, EXAMPLES_RUN // 2))
@given(case=mutated(env_only=True))
def test_bad_overrides_load_or_name_the_variable(case: Case, tmp_path: Path) -> None:
    load_or_say_why(case, tmp_path)


#: The token files the checks after loading may be given, by name: missing, a directory, a
#: bad line, or good ones.
TOKEN_FILES = {"missing": None, "directory": "", "bad": "short\n", "admins": "a" * 20 + "\n"}
TOKEN_FILES["orgs"] = "acme " + "o" * 20 + "\n"


@st.composite
def checked_keys(draw: st.DrawFn) -> tuple[str, dict[str, Any], dict[str, str | None]]:
    """A base document, and the keys the checks after loading read (`api.host`, the token
    files): each left alone, or set in the file (`None` in the third item) or by a
    variable."""
    base, doc = draw(st.sampled_from(BASES))
    doc = copy.deepcopy(doc)
    if draw(st.booleans()):
        # Without tokens, an address reachable from other machines is refused.
        doc["api"]["admin_tokens"], doc["api"]["org_tokens"] = [], {}
    keys: dict[str, str | None] = {}
    for key, values in (
        ("host", ["0.0.0.0", "127.0.0.1"]),
        ("admin_tokens_file", list(TOKEN_FILES)),
        ("org_tokens_file", list(TOKEN_FILES)),
    ):
        value = draw(st.sampled_from([None, *values]))
        if value is None:
            continue
        doc["api"][key] = value
        keys[key] = draw(st.sampled_from([None, f"STOKER_API__{key.upper()}"]))
    return base, doc, keys


@settings(FUZZ, max_examples=max(1, EXAMPLES_RUN // 4))
@given(drawn=checked_keys())
def test_the_checks_after_loading_name_where_the_key_was_set(
    drawn: tuple[str, dict[str, Any], dict[str, str | None]], tmp_path: Path
) -> None:
    base, doc, keys = drawn
    for name, text in TOKEN_FILES.items():
        file = tmp_path / name
        if text == "" and not file.is_dir():
            file.mkdir()
        elif text:
            file.write_text(text, encoding="utf-8")
    env: dict[str, str] = {}
    for key, variable in keys.items():
        if key.endswith("_file"):
            doc["api"][key] = str(tmp_path / doc["api"][key])
        if variable is not None:
            env[variable] = doc["api"].pop(key)
    load_or_say_why(Case(base, doc, env, (f"checked keys {keys}",)), tmp_path)


def run_config_check(path: Path, env: dict[str, str]) -> tuple[int, str, str]:
    """`stoker config check --config path` in this process, with exactly `env`'s overrides."""
    out, err = io.StringIO(), io.StringIO()
    environ = {k: v for k, v in os.environ.items() if not k.startswith("STOKER_")}
    with (
        mock.patch.dict(os.environ, {**environ, **env}, clear=True),
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
        pytest.raises(SystemExit) as ended,
    ):
        main(["config", "check", "--config", str(path)])
    code = ended.value.code
    return (code if isinstance(code, int) else 1), out.getvalue(), err.getvalue()


def _settable(name: str, value: str) -> bool:
    """Whether a process environment can hold this variable (no `=` in its name, no NUL)."""
    return "=" not in name and "\x00" not in name + value


@settings(FUZZ, max_examples=max(1, EXAMPLES_RUN // 10))
@given(case=mutated())
def test_config_check_says_why_and_never_shows_a_secret(case: Case, tmp_path: Path) -> None:
    env = {k: v for k, v in case.env.items() if _settable(k, v)}
    case = dataclasses.replace(case, env=env)
    path = write_doc(tmp_path, case.doc)
    try:
        load_config(path, case.env)
        loads = True
    except ConfigError:
        loads = False
    code, out, err = run_config_check(path, case.env)
    assert "Traceback" not in out + err, (case, err)
    if loads and code == 0:
        assert out.startswith("# effective config of "), (case, out)
    else:
        assert code == 1, (case, code, err)
        lines = err.strip().splitlines()
        assert lines and all(line.startswith("config error: ") for line in lines), (case, err)
    for secret in secrets_in(case):
        assert secret not in out + err, (case, secret)
