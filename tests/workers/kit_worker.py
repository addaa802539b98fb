"""A worker on the standard library's `http.server` and the kit, `stoker.worker`.

Run as `python kit_worker.py PORT [--careless]`. It is what the worker protocol asks of
any worker, in a few lines: the kit answers `/healthz`, `/activate` and the token check,
the worker serves the rest (`GET /` says which org it holds). `--careless` makes it a
deliberately broken worker, one that trusts any activation without its signature: what
`stoker worker-check` must catch.
"""

from __future__ import annotations

import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from stoker.worker import Reply, WorkerProtocol, signature


class CarelessProtocol(WorkerProtocol):
    """Broken on purpose: signs every activation itself instead of checking it."""

    def activate(self, method: str, path: str, body: bytes, signed: str | None) -> Reply:
        return super().activate(method, path, body, signature(self.secret, method, path, body))


def main() -> None:
    port = int(sys.argv[1])
    kind = CarelessProtocol if "--careless" in sys.argv[2:] else WorkerProtocol
    protocol = kind.from_env()

    class Handler(BaseHTTPRequestHandler):
        def handle_one(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length)
            path = self.path.split("?", 1)[0]
            headers = dict(self.headers.items())
            reply = protocol.answer(self.command, path, headers, body)
            if reply is None:
                reply = Reply(200, {"org": protocol.org, "epoch": protocol.epoch})
            content = reply.json()
            self.send_response(reply.status)
            self.send_header("Content-Type", reply.content_type)
            self.send_header("Content-Length", str(len(content)))
            for name, value in reply.headers.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(content)

        do_GET = do_POST = do_DELETE = handle_one

        def log_message(self, format: str, *args: object) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    print(json.dumps({"listening": port}), flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
