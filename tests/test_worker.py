"""The worker kit, `stoker.worker`: standard library only, and the protocol's test vector.

Its behaviour over HTTP is pinned by the demo worker's tests (`tests/test_demo_worker.py`)
and by `stoker worker-check` (`tests/test_worker_check.py`), both on real processes.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import stoker.worker
from stoker.domain.activation import ActivationKey
from stoker.worker import WorkerProtocol, signature, signature_valid

DOC = Path(__file__).resolve().parents[1] / "docs" / "worker-protocol.md"

#: Prints the modules `import stoker.worker` loads on top of a bare interpreter's.
_LOADED = """
import sys
before = set(sys.modules)
import stoker.worker
print("\\n".join(sorted(set(sys.modules) - before)))
"""


def test_the_kit_imports_nothing_but_the_standard_library() -> None:
    loaded = subprocess.run(
        [sys.executable, "-I", "-c", _LOADED], capture_output=True, text=True, check=True
    ).stdout.split()
    outside = [
        name
        for name in loaded
        if name.split(".")[0] not in sys.stdlib_module_names and not name.startswith("stoker")
    ]
    assert outside == []
    assert {name for name in loaded if name.startswith("stoker")} == {
        "stoker",
        "stoker._version",
        "stoker.worker",
    }


def test_the_kit_works_as_a_copied_file(tmp_path: Path) -> None:
    """A worker image without stoker installed may carry the one file."""
    shutil.copy(stoker.worker.__file__, tmp_path / "stoker_worker.py")
    code = (
        "import stoker_worker as w; p = w.WorkerProtocol('w-1', 's' * 64);"
        "print(p.answer('GET', '/healthz', {}, b'').status)"
    )
    out = subprocess.run(
        # -S: no site-packages, so no installed stoker; the copy is found in the cwd.
        [sys.executable, "-S", "-E", "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "200"


def test_the_documented_test_vector_holds() -> None:
    """docs/worker-protocol.md gives a key, a worker id, a body and their signature, for
    implementers in other languages: they are what the control plane computes."""
    doc = DOC.read_text()
    text = doc[doc.index("A test vector") :]

    def field(name: str) -> str:
        match = re.search(rf"^{name} +(\S+)", text, re.M)
        assert match is not None, name
        return match.group(1)

    key = ActivationKey(field("fleet key").encode())
    secret = key.worker_secret(field("worker id"))
    assert secret == field("secret")
    body = field("body").encode()
    header = re.search(r"^header +Stoker-Signature: (\S+)", text, re.M)
    assert header is not None
    assert signature(secret, "POST", "/activate", body) == header.group(1)
    assert signature_valid(secret, "POST", "/activate", body, header.group(1))
    assert not signature_valid(secret, "POST", "/activate", body + b" ", header.group(1))


def test_the_secret_never_shows_in_the_protocols_repr() -> None:
    protocol = WorkerProtocol("w-1", "s3cr3t" * 10)
    reply = protocol.answer("POST", "/activate", {}, b"{}")
    assert reply is not None and reply.status == 401
    assert "s3cr3t" not in repr(protocol)


def test_an_accepted_activation_keeps_its_traceparent_and_a_refused_one_does_not() -> None:
    protocol = WorkerProtocol("w-1", "s" * 64)
    trace = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"

    def activate(epoch: int, *, signed: bool, traceparent: str | None) -> int:
        body = (
            f'{{"worker_id":"w-1","org":"acme","epoch":{epoch},"token":"t{epoch}","config":{{}}}}'
        ).encode()
        headers = {"Stoker-Signature": signature("s" * 64, "POST", "/activate", body)}
        if not signed:
            headers["Stoker-Signature"] = "v1=00"
        if traceparent is not None:
            headers["Traceparent"] = traceparent
        reply = protocol.answer("POST", "/activate", headers, body)
        assert reply is not None
        return reply.status

    # The header is outside the signature: a signed activation with it is accepted.
    assert activate(1, signed=True, traceparent=trace) == 200
    assert protocol.traceparent == trace
    assert activate(2, signed=False, traceparent="00-" + "1" * 32 + "-" + "2" * 16 + "-01") == 401
    assert protocol.traceparent == trace
    assert activate(3, signed=True, traceparent=None) == 200
    assert protocol.traceparent is None
