"""Who a bearer token is: the admin and org tokens of the config and of token files.

Tokens come from `api.admin_tokens` / `api.org_tokens` and from the files named by
`api.admin_tokens_file` (one token a line) and `api.org_tokens_file` (`<org> <token>` a
line); in both files blank lines and lines beginning with `#` are skipped. The files are
read at start (a bad file is a config error) and again on SIGHUP or when one of them
changes (`reload_if_changed`, polled by the server): rotating a token is writing the file,
with no restart. A reload that finds a bad file keeps the tokens in force and logs why,
never a token.
"""

from __future__ import annotations

import hmac
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from stoker.config import ApiConfig, ConfigKeyError
from stoker.domain.errors import ConfigError, Forbidden

logger = logging.getLogger("stoker.api")

#: What a token may be (as `config.names.Token`): 16-512 visible ASCII characters.
_TOKEN = re.compile(r"[\x21-\x7e]{16,512}")
_TOKEN_RULE = "a token must be 16 to 512 visible ASCII characters"


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: an admin (every org) or one org."""

    admin: bool
    org: str | None = None

    def check_org(self, org: str) -> None:
        """Raise `Forbidden` unless this caller may act for `org`."""
        if not self.admin and self.org != org:
            raise Forbidden(f"this token acts for org {self.org!r}, not for {org!r}")

    def check_admin(self) -> None:
        """Raise `Forbidden` unless this caller holds an admin token."""
        if not self.admin:
            raise Forbidden("an admin token is required")


ANONYMOUS_ADMIN = Principal(admin=True)


class TokenTable:
    """The tokens in force and whom each stands for; reloadable from the token files."""

    def __init__(self, api: ApiConfig) -> None:
        """Read every token of `api` (ConfigError naming the file and line if one is bad)."""
        self._api = api
        self._files = [
            Path(f) for f in (api.admin_tokens_file, api.org_tokens_file) if f is not None
        ]
        self._stamps = self._stat()
        self.tokens: dict[bytes, Principal] = self._read()

    def match(self, credential: bytes) -> Principal | None:
        """Whom `credential` stands for, or None."""
        found = None
        # Compare with every token in constant time, so timing tells nothing about them.
        for token, principal in self.tokens.items():
            if hmac.compare_digest(token, credential):
                found = principal
        return found

    def reload(self) -> bool:
        """Read the token files again; on a bad file keep the tokens in force. True if the
        new tokens are in force."""
        self._stamps = self._stat()
        try:
            tokens = self._read()
        except ConfigError as exc:
            logger.error("event=tokens_reload_failed error=%r (the previous tokens stay)", str(exc))
            return False
        self.tokens = tokens
        admins = sum(1 for p in tokens.values() if p.admin)
        logger.info("event=tokens_reloaded admin=%d org=%d", admins, len(tokens) - admins)
        return True

    def reload_if_changed(self) -> bool:
        """Reload when a token file changed since the last read (its size, time or inode,
        which also catches a Kubernetes Secret's symlink swap). True if it reloaded."""
        if not self._files or self._stat() == self._stamps:
            return False
        return self.reload()

    def _stat(self) -> list[tuple[int, int, int] | None]:
        stamps: list[tuple[int, int, int] | None] = []
        for path in self._files:
            try:
                st = os.stat(path)
            except OSError:
                stamps.append(None)
                continue
            stamps.append((st.st_ino, st.st_size, st.st_mtime_ns))
        return stamps

    def _read(self) -> dict[bytes, Principal]:
        api = self._api
        admins = set(api.admin_tokens)
        orgs = dict(api.org_tokens)
        if api.admin_tokens_file is not None:
            for line in _lines(api.admin_tokens_file, "admin_tokens_file"):
                token = _token(line, line.text)
                if token in admins:
                    raise line.problem("repeats a token")
                if token in orgs:
                    raise line.problem("a token is both an admin and an org token")
                admins.add(token)
        if api.org_tokens_file is not None:
            for line in _lines(api.org_tokens_file, "org_tokens_file"):
                org, _, token = line.text.partition(" ")
                if not token.strip():
                    raise line.problem("expected '<org> <token>'")
                token = _token(line, token.strip())
                if len(org) > 128:
                    raise line.problem("an org name is 1 to 128 characters")
                if token in orgs:
                    raise line.problem("repeats a token")
                if token in admins:
                    raise line.problem("a token is both an admin and an org token")
                orgs[token] = org
        table = {t.encode(): Principal(admin=True) for t in admins}
        table.update({t.encode(): Principal(admin=False, org=o) for t, o in orgs.items()})
        return table


@dataclass(frozen=True, slots=True)
class _Line:
    """A meaningful line of the token file that `api.<key>` names."""

    key: str
    path: str
    number: int
    text: str

    def problem(self, problem: str) -> ConfigKeyError:
        """The config error of this line: `api.<key> (<path>) line <n>: <problem>`."""
        where = f"api.{self.key} ({self.path}) line {self.number}"
        return ConfigKeyError(("api", self.key), problem, where=where)


def _lines(path: str, key: str) -> list[_Line]:
    """The meaningful lines of the token file `api.<key>` names."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else "not readable"
        raise ConfigKeyError(("api", key), f"cannot read {path!r}: {reason}") from None
    return [
        _Line(key, path, n, line.strip())
        for n, line in enumerate(text.splitlines(), 1)
        if line.strip() and not line.lstrip().startswith("#")
    ]


def _token(line: _Line, token: str) -> str:
    if _TOKEN.fullmatch(token) is None:
        raise line.problem(_TOKEN_RULE)
    return token
