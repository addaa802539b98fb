"""The `activation` section: where the fleet activation key comes from, and loading it.

Every activation the control plane sends is signed with a secret derived from the fleet
key (`stoker.domain.activation`); every replica sharing a store must hold the same key,
or workers spawned by one replica refuse the activations of another. The key is, in this
order: `activation.key` (e.g. `STOKER_ACTIVATION__KEY` from a Kubernetes Secret), the file
`activation.key_file`, or a file next to the SQLite database. A key file that does not
exist is created at first start with a random key, readable by its owner only (0600).
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

from pydantic import Field, SecretStr, field_validator

from stoker.config.problems import ConfigKeyError
from stoker.config.schema import Section
from stoker.domain.activation import MIN_KEY_BYTES, ActivationKey
from stoker.domain.errors import ConfigError, one_line

#: The default key file is the SQLite file's name plus this suffix.
KEY_FILE_SUFFIX = ".activation-key"
#: Longest key accepted, in characters.
MAX_KEY_CHARS = 4096


class ActivationConfig(Section):
    """How the control plane proves to its workers that an activation comes from it."""

    #: The fleet key itself (at least 32 printable characters); wins over `key_file`.
    #: Meant for `STOKER_ACTIVATION__KEY` set from a secret store, not for the file.
    key: SecretStr | None = None
    #: A file holding the fleet key, created (0600, random) when missing. Null: the
    #: SQLite file's path plus `.activation-key`; with PostgreSQL, `key` or `key_file`
    #: is required, as every replica must hold the same key.
    key_file: str | None = Field(None, min_length=1)

    @field_validator("key")
    @classmethod
    def _key_strength(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None:
            return None
        text = value.get_secret_value()
        if len(text) < MIN_KEY_BYTES or len(text) > MAX_KEY_CHARS:
            raise ValueError(
                f"must be {MIN_KEY_BYTES} to {MAX_KEY_CHARS} characters "
                "(e.g. the output of `openssl rand -hex 32`)"
            )
        if not text.isprintable() or text != text.strip():
            raise ValueError("must be printable characters without surrounding spaces")
        return value


def load_activation_key(section: ActivationConfig, *, sqlite_path: str | None) -> ActivationKey:
    """The fleet key `section` names; `sqlite_path` is the store's file (None: PostgreSQL).

    Raises `ConfigError` naming the key to set when there is no key to read, the file
    cannot be read or created, or it holds too short a key.
    """
    if section.key is not None:
        return ActivationKey(section.key.get_secret_value().encode())
    path = section.key_file
    if path is None and sqlite_path is not None:
        if sqlite_path == ":memory:":
            # The store lives as long as this process: so may the key.
            return ActivationKey(secrets.token_hex(32).encode())
        path = sqlite_path + KEY_FILE_SUFFIX
    if path is None:
        raise ConfigKeyError(
            ("activation", "key_file"),
            "replicas sharing a PostgreSQL store must share one activation key: set "
            "activation.key_file (a file, created if missing) or STOKER_ACTIVATION__KEY (at "
            "least 32 characters, e.g. `openssl rand -hex 32`)",
        )
    try:
        return ActivationKey(read_or_create_key(Path(path)))
    except ConfigError as exc:
        if section.key_file is not None:
            raise
        # The default file: its problem is the store's path, which is what to change.
        reason = str(exc).split(": ", 2)[-1]
        raise ConfigKeyError(
            ("store",), f"the activation key next to the SQLite file: {reason}"
        ) from None


def read_or_create_key(path: Path) -> bytes:
    """The key in `path`, created first (0600, 32 random bytes in hex) when missing.

    Two replicas starting together on one machine get the same key: the file is written
    under a temporary name and linked into place, so it is never seen half-written and
    the first link wins.
    """
    try:
        return _read_key(path)
    except FileNotFoundError:
        pass
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="ascii") as out:
            out.write(secrets.token_hex(32) + "\n")
            out.flush()
            os.fsync(out.fileno())
        with contextlib.suppress(FileExistsError):
            os.link(temporary, path)
    except OSError as exc:
        raise ConfigKeyError(
            ("activation", "key_file"), f"cannot create {path}: {exc.strerror or exc}"
        ) from None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
    return _read_key(path)


def _read_key(path: Path) -> bytes:
    """The stripped content of `path`; FileNotFoundError when it does not exist."""
    try:
        key = path.read_bytes().strip()
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise ConfigKeyError(
            ("activation", "key_file"), f"cannot read {one_line(str(path))}: {exc.strerror or exc}"
        ) from None
    if len(key) < MIN_KEY_BYTES:
        raise ConfigKeyError(
            ("activation", "key_file"),
            f"{path} holds {len(key)} bytes; an activation key needs at least {MIN_KEY_BYTES}",
        )
    return key
