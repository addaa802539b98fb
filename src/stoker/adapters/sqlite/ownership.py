"""Who uses a SQLite file, and whether it is still the file the store opened.

One `stoker serve` per file: a second one on the same file would take the first one's
warm workers, and each would retire the other's as stranded. `hold` takes an exclusive
lock on `<file>.lock` for the life of the process (the kernel drops it when the process
dies, however it dies) and writes the holder's pid in it, for the message of the next one.

`FileIdentity` notices a database file deleted or replaced under a running server: SQLite
keeps writing to the unlinked file, and the next start would find an empty store and
treat every running worker as stranded.
"""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass
from typing import IO

from stoker.domain.errors import StoreError


def hold(path: str) -> IO[str]:
    """Lock `<path>.lock` for this process; StoreError naming the holder if another has it.

    Keep the returned file open for as long as the server runs.
    """
    lock_path = f"{path}.lock"
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        raise StoreError(
            f"cannot open sqlite store {path!r}: its lock file {lock_path}: {exc.strerror}"
        ) from None
    file = os.fdopen(fd, "r+")
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = file.read().strip()
        file.close()
        who = f" (pid {holder})" if holder.isdigit() else ""
        raise StoreError(
            f"another stoker serve{who} is using {path}: one server per SQLite file "
            "(several replicas share a PostgreSQL store)"
        ) from None
    file.truncate(0)
    file.write(f"{os.getpid()}\n")
    file.flush()
    return file


@dataclass(frozen=True, slots=True)
class FileIdentity:
    """The device and inode of the database file as opened."""

    path: str
    device: int
    inode: int

    @classmethod
    def of(cls, path: str) -> FileIdentity:
        st = os.stat(path)
        return cls(path, st.st_dev, st.st_ino)

    def check(self) -> None:
        """StoreError when the path no longer names the file the store has open."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            raise StoreError(
                f"the database file {self.path} was deleted while the server ran: "
                "its writes go nowhere (stop the server, restore the file or start afresh)"
            ) from None
        if (st.st_dev, st.st_ino) != (self.device, self.inode):
            raise StoreError(
                f"the database file {self.path} was replaced while the server ran: "
                "it is not the file the server opened (stop the server and restart it)"
            )
