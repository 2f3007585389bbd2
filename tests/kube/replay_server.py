"""A Kubernetes API server that replays recorded list responses and watch streams, on 127.0.0.1.

The official `kubernetes` client is pointed at it (Configuration.host). Per resource path it serves
list responses (`lists`, in order; the last one repeats) and watch sessions (`sessions`, in order):
each session streams its events as chunked newline-delimited JSON (`{"type": "ADDED", "object": ...}`,
BOOKMARK events included), then ends in one of these ways:

- "close": the response ends cleanly (as a watch whose timeoutSeconds ran out);
- "drop":  the connection is cut in the middle of a chunk (the client must reconnect from the last
           resourceVersion it saw);
- "gone":  an ERROR event carrying a 410 Expired Status (the client raises ApiException(410) and
           the agent must list again).

Once its sessions are used up, a watch idles briefly and closes cleanly. A list asked with `limit`
is served in pages, as the API server's chunked lists: each page names a `continue` token for the
rest of the same list body; the first `expire_continue` continued requests of a resource are
answered 410 Expired instead (the token is too old: the client must list again from the start).
Every request is recorded (`requests`: path, query) so a test can check that reconnects asked for
the right resourceVersion.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

GONE = {"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                                    "message": "too old resource version: 100 (200)", "reason": "Expired",
                                    "code": 410}}


EXPIRED_CONTINUE = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "reason": "Expired",
                    "message": "The provided continue parameter is too old to display a consistent list result. You "
                               "can start a new list without the continue parameter.", "code": 410}


@dataclass
class Session:
    events: list[dict]
    end: str = "close"   # close | drop | gone


@dataclass
class Resource:
    lists: list[dict]                       # full list bodies ({"kind", "apiVersion", "metadata", "items"})
    sessions: list[Session] = field(default_factory=list)
    idle_s: float = 0.2
    expire_continue: int = 0                # continued list requests to answer 410 Expired


def list_body(kind: str, resource_version: str, items: list[dict], api_version: str = "v1") -> dict:
    return {"kind": kind, "apiVersion": api_version, "metadata": {"resourceVersion": resource_version},
            "items": items}


def bookmark(kind: str, resource_version: str, api_version: str = "v1") -> dict:
    return {"type": "BOOKMARK", "object": {"kind": kind, "apiVersion": api_version,
                                           "metadata": {"resourceVersion": resource_version}}}


class ReplayApiServer:
    def __init__(self, resources: dict[str, Resource]):
        self.resources = resources
        self.requests: list[tuple[str, dict]] = []
        self._paged: list[dict] = []         # list bodies being served in pages; a token names one
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, fmt, *args):  # quiet
                pass

            def do_GET(self):  # noqa: N802
                url = urlparse(self.path)
                query = {k: v[-1] for k, v in parse_qs(url.query).items()}
                with server._lock:
                    server.requests.append((url.path, query))
                    resource = server.resources.get(url.path)
                    if resource is None:
                        self.send_error(404)
                        return
                    watching = query.get("watch") in ("true", "1")
                    status = 200
                    if watching:
                        session = resource.sessions.pop(0) if resource.sessions else None
                    elif "continue" in query and resource.expire_continue > 0:
                        resource.expire_continue -= 1
                        status, body = 410, EXPIRED_CONTINUE
                    elif "continue" in query:
                        which, offset = (int(x) for x in query["continue"].split(":"))
                        body = server._page(which, offset, int(query["limit"]))
                    else:
                        body = resource.lists.pop(0) if len(resource.lists) > 1 else resource.lists[0]
                        if "limit" in query:
                            server._paged.append(body)
                            body = server._page(len(server._paged) - 1, 0, int(query["limit"]))
                if not watching:
                    data = json.dumps(body).encode()
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                if session is None:  # nothing more recorded: a quiet watch window
                    time.sleep(min(resource.idle_s, float(query.get("timeoutSeconds", 1))))
                    self.wfile.write(b"0\r\n\r\n")
                    return
                for event in session.events:
                    self._chunk(json.dumps(event).encode() + b"\n")
                if session.end == "gone":
                    self._chunk(json.dumps(GONE).encode() + b"\n")
                if session.end == "drop":
                    line = json.dumps(session.events[0] if session.events else GONE).encode() + b"\n"
                    self.wfile.write(b"%x\r\n" % len(line) + line[: len(line) // 2])  # cut mid-chunk
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(b"0\r\n\r\n")

            def _chunk(self, data: bytes) -> None:
                self.wfile.write(b"%x\r\n" % len(data) + data + b"\r\n")
                self.wfile.flush()

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def _page(self, which: int, offset: int, limit: int) -> dict:
        body = self._paged[which]
        items = body["items"][offset:offset + limit]
        meta = dict(body["metadata"])
        if offset + limit < len(body["items"]):
            meta.update({"continue": f"{which}:{offset + limit}", "remainingItemCount": len(body["items"]) - offset - limit})
        return {**body, "metadata": meta, "items": items}

    def watch_versions(self, path: str) -> list[str | None]:
        """resourceVersion of every watch request on `path`, in order."""
        return [q.get("resourceVersion") for p, q in self.requests if p == path and q.get("watch") in ("true", "1")]

    def list_count(self, path: str) -> int:
        """Lists asked for (a paged list counts once: its continued requests are not counted)."""
        return sum(1 for p, q in self.requests if p == path and q.get("watch") not in ("true", "1")
                   and "continue" not in q)

    def page_count(self, path: str) -> int:
        return sum(1 for p, q in self.requests if p == path and q.get("watch") not in ("true", "1"))

    def __enter__(self) -> "ReplayApiServer":
        threading.Thread(target=self._server.serve_forever, name="replay-api", daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
