"""A local stand-in of the Hugging Face Hub's HTTP API, for tests (never the network).

It implements the endpoints huggingface_hub 2.x calls for
- a download (`snapshot_download`): GET /api/models/ORG/NAME/revision/REV (the commit) and
  /api/models/ORG/NAME/tree/REV (the file list), HEAD and GET
  /ORG/NAME/resolve/REV/FILE (plain HTTP, no Xet headers, so the client downloads the bytes directly);
- an upload (`create_repo` + `upload_folder`): POST /api/repos/create, POST /api/validate-yaml (README.md metadata),
  POST /api/models/ORG/NAME/preupload/REV (answers `regular` for every file, so every file travels base64 inside
  the commit: the LFS / Xet transfer the real Hub asks for with large files is not covered), and
  POST /api/models/ORG/NAME/commit/REV (the NDJSON commit: header, then one line per file).
Every request is recorded (method, path, headers, body) for the tests to check what the client sent. Writes with
the token `refused_token` get HTTP 401.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class HubStandIn:
    def __init__(self) -> None:
        self.repos: dict[str, dict[str, bytes]] = {}  # repo id -> path -> content (the committed state)
        self.requests: list[dict[str, Any]] = []
        self.created: list[dict[str, Any]] = []
        self.commits: list[dict[str, Any]] = []
        self.refused_token = ""  # a token every write is refused with (HTTP 401)
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def start(self) -> "HubStandIn":
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def add_model(self, repo_id: str, files: dict[str, bytes]) -> None:
        self.repos[repo_id] = dict(files)

    def sha(self, repo_id: str) -> str:
        digest = hashlib.sha1()
        for path, content in sorted(self.repos.get(repo_id, {}).items()):
            digest.update(path.encode() + b"\0" + content)
        return digest.hexdigest()

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _body(self) -> bytes:
                n = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(n) if n else b""

            def _send(
                self,
                status: int,
                payload: Any = None,
                raw: bytes | None = None,
                head: bool = False,
                headers: dict[str, str] | None = None,
            ) -> None:
                body = raw if raw is not None else json.dumps(payload if payload is not None else {}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json" if raw is None else "application/octet-stream")
                self.send_header("Content-Length", str(len(body)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def _record(self, body: bytes) -> None:
                hub.requests.append(
                    {"method": self.command, "path": self.path, "headers": dict(self.headers), "body": body}
                )

            def do_HEAD(self):  # noqa: N802
                self._record(b"")
                self._resolve(head=True)

            def do_GET(self):  # noqa: N802
                self._record(b"")
                m = re.match(r"^/api/models/([^/]+/[^/]+)/revision/([^/?]+)", self.path)
                if m:
                    repo = m.group(1)
                    if repo not in hub.repos:
                        return self._send(
                            404, {"error": "Repository not found"}, headers={"X-Error-Code": "RepoNotFound"}
                        )
                    return self._send(
                        200,
                        {
                            "id": repo,
                            "modelId": repo,
                            "sha": hub.sha(repo),
                            "private": False,
                            "siblings": [{"rfilename": f} for f in sorted(hub.repos[repo])],
                        },
                    )
                m = re.match(r"^/api/models/([^/]+/[^/]+)/tree/([^/?]+)", self.path)
                if m and m.group(1) in hub.repos:
                    files = hub.repos[m.group(1)]
                    return self._send(
                        200,
                        [
                            {
                                "type": "file",
                                "path": f,
                                "size": len(files[f]),
                                "oid": hashlib.sha1(files[f]).hexdigest(),
                            }
                            for f in sorted(files)
                        ],
                    )
                self._resolve(head=False)

            def _resolve(self, head: bool) -> None:
                m = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+?)(\?.*)?$", self.path)
                if not m or m.group(1) not in hub.repos or m.group(3) not in hub.repos[m.group(1)]:
                    return self._send(
                        404, {"error": "Entry not found"}, head=head, headers={"X-Error-Code": "EntryNotFound"}
                    )
                repo, path = m.group(1), m.group(3)
                content = hub.repos[repo][path]
                etag = '"' + hashlib.sha256(content).hexdigest() + '"'
                self._send(200, raw=content, head=head, headers={"X-Repo-Commit": hub.sha(repo), "ETag": etag})

            def do_POST(self):  # noqa: N802
                body = self._body()
                self._record(body)
                if hub.refused_token and self.headers.get("authorization") == f"Bearer {hub.refused_token}":
                    return self._send(401, {"error": "Invalid credentials in Authorization header"})
                if self.path == "/api/repos/create":
                    data = json.loads(body)
                    hub.created.append(data)
                    repo = f"{data['organization']}/{data['name']}" if data.get("organization") else data["name"]
                    hub.repos.setdefault(repo, {})
                    return self._send(200, {"url": f"{hub.url}/{repo}", "name": repo})
                if self.path == "/api/validate-yaml":
                    return self._send(200, {"errors": [], "warnings": []})
                m = re.match(r"^/api/models/([^/]+/[^/]+)/preupload/([^/?]+)", self.path)
                if m:
                    files = json.loads(body)["files"]
                    return self._send(
                        200,
                        {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]},
                    )
                m = re.match(r"^/api/models/([^/]+/[^/]+)/commit/([^/?]+)", self.path)
                if m:
                    repo = m.group(1)
                    lines = [json.loads(ln) for ln in body.decode().splitlines() if ln.strip()]
                    header = next(ln["value"] for ln in lines if ln["key"] == "header")
                    files = {
                        ln["value"]["path"]: base64.b64decode(ln["value"]["content"])
                        for ln in lines
                        if ln["key"] == "file"
                    }
                    hub.commits.append({"repo": repo, "revision": m.group(2), "header": header, "files": files})
                    hub.repos.setdefault(repo, {}).update(files)
                    sha = hub.sha(repo)
                    return self._send(
                        200, {"commitUrl": f"{hub.url}/{repo}/commit/{sha}", "commitOid": sha, "success": True}
                    )
                self._send(404, {"error": f"not implemented by the stand-in: POST {self.path}"})

        return Handler
