"""A real HTTP server on 127.0.0.1 that speaks the Hugging Face Hub's file protocol.

Tests point ``HF_ENDPOINT`` at it and let huggingface_hub's real client (and the tool's own
range reader) talk to it. It serves what the Hub serves for model repos, as the client reads it:

- ``GET /api/models/{repo}/revision/{rev}``: repo info with ``sha`` and ``siblings``;
- ``GET /api/models/{repo}/tree/{rev}``: the file list with ``oid``, ``size`` and ``lfs``;
- ``HEAD``/``GET /{repo}/resolve/{rev}/{file}``: small files straight from the Hub origin
  (``ETag`` = git blob sha1), LFS files (``*.safetensors``) as a 302 to a second origin, the
  "CDN", with ``X-Linked-Etag`` (sha256) and ``X-Linked-Size``; every answer carries
  ``X-Repo-Commit``. The CDN serves the blob with ``Range`` (206 + ``Content-Range``).
- errors as the Hub sends them: 401/404 with ``X-Error-Code`` (``RepoNotFound``,
  ``RevisionNotFound``, ``EntryNotFound``, ``GatedRepo``) and ``X-Error-Message``.
- uploads as ``hf upload`` makes them (the CI recipe's publish step, docs/ci.md): ``POST
  /api/repos/create``, ``POST /api/models/{repo}/preupload/{rev}`` (``*.safetensors`` by LFS,
  the rest inline), the LFS batch API with "basic" transfers (``POST
  /{repo}.git/info/lfs/objects/batch``, then ``PUT`` of each object, its sha256 checked) and
  ``POST /api/models/{repo}/commit/{rev}`` (NDJSON): a new commit on ``rev`` holding the
  parent's files and the ones added, folders included (``pp2/model.safetensors.index.json``).

No Xet headers are ever sent. Every request is logged (origin, method, path, Range, status,
body bytes sent, whether an Authorization header came, the User-Agent) so that tests can assert
exactly what was fetched, and by whom. Faults can be injected: drop the connection after N body
bytes of a matching response, answer an error status to any request (API calls included: 429
and 503 as a server asking for fewer requests), or ignore ``Range`` altogether.

The server can be paced like a wide-area link (:meth:`HubServer.set_pacing`): every request
waits ``latency`` seconds before its answer, and each answer's body goes out at ``rate`` bytes/s
at most (per connection: one request at a time per connection). ``peak_in_flight`` is the most
requests it answered at once.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import shutil
import socket
import struct
import tempfile
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

LFS_SUFFIXES = (".safetensors",)
_RANGE = re.compile(r"bytes=(\d+)-(\d*)$")


@dataclass
class Repo:
    """A repo's files at each commit; ``refs`` maps branch/tag names to commits."""

    files: dict[str, dict[str, Path]]  # commit -> {name: local path}
    refs: dict[str, str]
    gated: bool = False  # only ``token`` gets in
    private: bool = False  # like gated, but hidden: RepoNotFound without the token
    token: str | None = None


def pace_piece(rate: float | None) -> int:
    """How many bytes a paced answer writes at a time: 64 KiB, or what the rate sends in 20 ms
    where that is less (4 KiB at least), so a small body is paced too rather than written at once."""
    return min(64 * 1024, max(4096, int(rate / 50))) if rate else 64 * 1024


@dataclass
class LogEntry:
    origin: str  # "hub" or "cdn"
    method: str
    path: str
    range: str | None
    status: int
    sent: int  # body bytes actually written
    auth: bool  # an Authorization header was sent
    started: float = 0.0  # when the request came in: the log is in this order
    agent: str = ""  # the User-Agent header: which process (or rank) asked
    ended: float = 0.0  # when the answer's last byte was sent: [started, ended) is in flight
    # Just before the write that sent the answer's last byte: the client cannot have that byte
    # sooner, so a request it sends once it has the answer starts after this however late the
    # server's thread gets to record ``ended`` (on a busy machine, after that next request came).
    answered: float = 0.0

    @property
    def file(self) -> str:
        """The repo file a resolve request or a CDN blob request is about ('' otherwise)."""
        return self.path.rsplit("/", 1)[-1] if self.origin == "cdn" or "/resolve/" in self.path else ""


@dataclass
class Fault:
    """Spoil the next ``times`` GET responses for ``file``: drop the connection after ``after``
    body bytes (``status=None``), answer ``status`` instead (503, or 403 as an expired CDN
    signature), or with ``shift`` send the bytes one further on and say so in Content-Range.
    With ``stall`` (seconds): after ``after`` body bytes, go silent that long (or until the
    server stops) with the connection open, then drop it: a stalled stream.

    With ``path`` instead of ``file``: answer ``status`` to the next ``times`` requests (any
    method, either origin) whose path ``path`` matches (a regex searched in it), e.g.
    ``/revision/main`` for resolving the revision; with ``reset`` as well, reset their
    connection instead of answering."""

    file: str = ""
    after: int = 0
    times: int = 1
    ranged: bool | None = None  # only ranged (True) / only whole (False) requests; None: both
    status: int | None = None
    shift: bool = False
    path: str | None = None
    stall: float = 0.0
    retry_after: int | None = None  # with ``status``: the Retry-After header (seconds)
    reset: bool = False  # with ``path``: no answer, the connection reset (a TCP RST)


@dataclass
class _State:
    repos: dict[str, Repo] = field(default_factory=dict)
    log: list[LogEntry] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    ignore_range: bool = False
    # Bearer tokens the Hub knows (None: any token passes, as before); an unknown one gets what
    # the Hub answers to every request with it: 401 "Invalid credentials in Authorization header".
    tokens: set[str] | None = None
    blobs: dict[str, Path] = field(default_factory=dict)  # sha256 -> path
    ignore_blobs: bool = False  # model info without sizes even when asked: a mirror behind on the API
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Requests being answered: an entry is logged only after its answer was sent, so a client can
    # have read a whole answer before its entry is there; the tests' view waits for these.
    in_flight: int = 0
    peak_in_flight: int = 0
    settled: threading.Condition = field(default_factory=threading.Condition)
    rate: float | None = None  # body bytes/s per connection (None: as fast as it goes)
    latency: float = 0.0  # seconds every request waits before its answer
    stopped: threading.Event = field(default_factory=threading.Event)  # ends stalls


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _git_blob_sha1(path: Path) -> str:
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


class HubServer:
    """The Hub origin and the CDN origin, each a ThreadingHTTPServer on 127.0.0.1."""

    def __init__(self, *, hash_lfs: bool = True) -> None:
        """``hash_lfs=False`` stands in a digest of name and size for each LFS file's sha256:
        for benchmarks that serve huge sparse checkpoints and read only their headers."""
        self.hash_lfs = hash_lfs
        self.state = _State()
        self._meta: dict[Path, dict] = {}
        self.uploads = Path(tempfile.mkdtemp(prefix="fake-hub-uploads-"))  # what clients pushed
        self.hub = _serve(self, "hub")
        self.cdn = _serve(self, "cdn")
        self.url = f"http://127.0.0.1:{self.hub.server_address[1]}"
        self.cdn_url = f"http://127.0.0.1:{self.cdn.server_address[1]}"

    # ------------------------------------------------------------------ setup

    def add_repo(
        self,
        repo_id: str,
        model_dir: Path,
        *,
        commit: str | None = None,
        branch: str = "main",
        tags: tuple[str, ...] = (),
        gated: bool = False,
        private: bool = False,
        token: str | None = None,
    ) -> str:
        """Publish the top-level files of ``model_dir`` as ``repo_id`` at ``commit`` (default: a
        sha1 of the file digests), reachable as ``branch`` and each of ``tags``. Returns the commit."""
        files = {
            p.name: p for p in sorted(Path(model_dir).iterdir()) if p.is_file() and not p.name.startswith(".")
        }
        for p in files.values():
            self._describe(p)
        if commit is None:
            commit = hashlib.sha1(
                json.dumps(sorted((n, self._meta[p]["oid"]) for n, p in files.items())).encode()
            ).hexdigest()
        repo = self.state.repos.get(repo_id)
        if repo is None:
            repo = self.state.repos[repo_id] = Repo({}, {}, gated=gated, private=private, token=token)
        repo.files[commit] = files
        for ref in (branch, *tags):
            repo.refs[ref] = commit
        return commit

    def check_tokens(self, *valid: str) -> None:
        """From now on, refuse every request whose token is not one of ``valid`` (nor a repo's)."""
        self.state.tokens = set(valid) | {r.token for r in self.state.repos.values() if r.token}

    def move(self, repo_id: str, commit: str, *, branch: str = "main") -> None:
        """Point ``branch`` of ``repo_id`` at ``commit`` (published before), as a push does."""
        repo = self.state.repos[repo_id]
        assert commit in repo.files, f"{commit} was never published to {repo_id}"
        repo.refs[branch] = commit

    def _describe(self, path: Path) -> dict:
        meta = self._meta.get(path)
        if meta is None:
            size = path.stat().st_size
            if path.name.endswith(LFS_SUFFIXES):
                sha = (
                    _sha256(path) if self.hash_lfs else hashlib.sha256(f"{path}:{size}".encode()).hexdigest()
                )
                pointer = _lfs_pointer(sha, size)
                oid = hashlib.sha1(b"blob %d\0" % len(pointer) + pointer).hexdigest()
                meta = {
                    "size": size,
                    "oid": oid,
                    "lfs": {"oid": sha, "size": size, "pointerSize": len(pointer)},
                }
                self.state.blobs[sha] = path
            else:
                meta = {"size": size, "oid": _git_blob_sha1(path), "lfs": None}
            self._meta[path] = meta
        return meta

    # ------------------------------------------------------------------ tests' view

    @property
    def log(self) -> list[LogEntry]:
        """Every request so far, in the order they came in, once none is still being answered."""
        with self.state.settled:
            self.state.settled.wait_for(lambda: self.state.in_flight == 0, timeout=10)
        with self.state.lock:
            return sorted(self.state.log, key=lambda e: e.started)

    def clear_log(self) -> None:
        with self.state.lock:
            self.state.log.clear()

    def add_fault(self, fault: Fault) -> None:
        with self.state.lock:
            self.state.faults.append(fault)

    def set_ignore_range(self, value: bool) -> None:
        self.state.ignore_range = value

    def set_pacing(self, rate: float | None = None, latency: float = 0.0) -> None:
        """Pace every connection like a wide-area link: ``rate`` body bytes/s at most (None:
        unpaced) and ``latency`` seconds before each answer."""
        self.state.rate, self.state.latency = rate, latency

    @property
    def peak_in_flight(self) -> int:
        """The most requests answered at once so far."""
        return self.state.peak_in_flight

    def reset_peak(self) -> None:
        self.state.peak_in_flight = 0

    def stop(self) -> None:
        self.state.stopped.set()
        for server in (self.hub, self.cdn):
            server.shutdown()
            server.server_close()
        shutil.rmtree(self.uploads, ignore_errors=True)

    def __enter__(self) -> HubServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # Connections waiting to be accepted. socketserver's default, 5, is no server's: a client
    # opening a few dozen connections at once (a header read per shard) overflows it while this
    # one thread accepts, and the kernel drops the SYNs past it (TcpExt ListenOverflows), each
    # connection then waiting out TCP's 1 s retransmit: a stall the Hub's front never causes
    # (nginx's default backlog is 511, Linux's somaxconn 4096).
    request_queue_size = 512

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a client that hangs up (as the retry tests make it) is not the server's problem


def _serve(owner: HubServer, origin: str) -> ThreadingHTTPServer:
    handler = type(f"{origin}Handler", (_Handler,), {"owner": owner, "origin": origin})
    server = _Server(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, name=f"fake-hub-{origin}", daemon=True).start()
    return server


class _StampedWriter:
    """The handler's socket writer, noting the time before each write (see ``LogEntry.answered``)."""

    def __init__(self, inner: object) -> None:
        self.inner, self.last = inner, 0.0

    def write(self, b: bytes) -> int:
        self.last = time.monotonic()
        return self.inner.write(b)

    def flush(self) -> None:
        self.inner.flush()

    def __getattr__(self, name: str) -> object:  # closed, close, ...: the handler's finish() asks
        return getattr(self.inner, name)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    owner: HubServer
    origin: str

    def setup(self) -> None:
        super().setup()
        self.wfile = _StampedWriter(self.wfile)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - quiet
        pass

    def do_HEAD(self) -> None:
        self._dispatch(head=True)

    def do_GET(self) -> None:
        self._dispatch(head=False)

    def do_POST(self) -> None:
        self._dispatch(head=False)

    def do_PUT(self) -> None:
        self._dispatch(head=False)

    # ------------------------------------------------------------------ routing

    def _dispatch(self, *, head: bool) -> None:
        with self.owner.state.settled:
            self.owner.state.in_flight += 1
            self.owner.state.peak_in_flight = max(self.owner.state.peak_in_flight, self.owner.state.in_flight)
        self._sent = 0
        self._status = 0
        started = time.monotonic()
        if self.owner.state.latency:
            time.sleep(self.owner.state.latency)
        try:
            fault = self._path_fault(unquote(urlsplit(self.path).path))
            if fault is not None and fault.reset:
                # SO_LINGER 0: close() sends RST, the peer's read fails (ECONNRESET).
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.close_connection = True
                self.connection.close()
            elif fault is not None:
                self._error(fault.status, None, "injected fault")
            elif self.command in ("POST", "PUT"):
                self._upload(unquote(urlsplit(self.path).path))
            elif self.origin == "cdn":
                self._cdn(head)
            else:
                self._hub(head)
        except (BrokenPipeError, ConnectionResetError):
            pass
        finally:
            ended = time.monotonic()
            answered = self.wfile.last if self.wfile.last >= started else ended
            with self.owner.state.lock:
                self.owner.state.log.append(
                    LogEntry(
                        self.origin,
                        self.command,
                        unquote(urlsplit(self.path).path),
                        self.headers.get("Range"),
                        self._status,
                        self._sent,
                        "Authorization" in self.headers,
                        started,
                        self.headers.get("User-Agent", ""),
                        ended,
                        answered,
                    )
                )
            with self.owner.state.settled:
                self.owner.state.in_flight -= 1
                self.owner.state.settled.notify_all()

    def _hub(self, head: bool) -> None:
        path = unquote(urlsplit(self.path).path)
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/revision/(.+)", path)
        if m:
            return self._revision_info(m.group(1), m.group(2))
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(/.*)?", path)
        if m:
            return self._tree(m.group(1), m.group(2), m.group(3))
        m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if m:
            return self._resolve(m.group(1), m.group(2), m.group(3), head)
        self._error(404, None, "Not Found")

    def _repo(self, repo_id: str) -> Repo | None:
        """The repo if this request may see it; otherwise the Hub's error is sent and None returned."""
        repo = self.owner.state.repos.get(repo_id)
        auth = self.headers.get("Authorization", "")
        known = self.owner.state.tokens
        if auth and known is not None and auth.removeprefix("Bearer ") not in known:
            self._error(401, None, "Invalid credentials in Authorization header")
            return None
        allowed = repo is not None and (not (repo.gated or repo.private) or auth == f"Bearer {repo.token}")
        if repo is None or (repo.private and not allowed):
            self._error(401 if not auth else 404, "RepoNotFound", "Repository not found")
            return None
        if repo.gated and not allowed:
            self._error(
                401 if not auth else 403,
                "GatedRepo",
                f"Access to model {repo_id} is restricted. You must have access to it and be authenticated "
                "to access it. Please log in.",
            )
            return None
        return repo

    def _commit(self, repo: Repo, rev: str) -> str | None:
        commit = repo.refs.get(rev, rev if rev in repo.files else None)
        if commit is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        return commit

    def _revision_info(self, repo_id: str, rev: str) -> None:
        blobs = parse_qs(urlsplit(self.path).query).get("blobs", [""])[0].lower() in ("1", "true")
        blobs = blobs and not self.owner.state.ignore_blobs
        repo = self._repo(repo_id)
        if repo is None or (commit := self._commit(repo, rev)) is None:
            return
        body = {
            "id": repo_id,
            "modelId": repo_id,
            "sha": commit,
            "private": repo.private,
            "gated": "manual" if repo.gated else False,
            "siblings": [
                self._sibling(name, path, blobs) for name, path in sorted(repo.files[commit].items())
            ],
        }
        self._json(body)

    def _sibling(self, name: str, path: Path, blobs: bool) -> dict:
        """A file as the Hub's model info lists it: its name, and with ``?blobs=true``
        (huggingface_hub's ``files_metadata=True``) its size, blob id and LFS sha256."""
        if not blobs:
            return {"rfilename": name}
        meta = self.owner._describe(path)
        out = {"rfilename": name, "blobId": meta["oid"], "size": meta["size"]}
        if meta["lfs"]:
            lfs = meta["lfs"]
            out["lfs"] = {"sha256": lfs["oid"], "size": lfs["size"], "pointerSize": lfs["pointerSize"]}
        return out

    def _tree(self, repo_id: str, rev: str, sub: str | None) -> None:
        repo = self._repo(repo_id)
        if repo is None or (commit := self._commit(repo, rev)) is None:
            return
        if sub not in (None, "", "/"):
            return self._error(404, "EntryNotFound", f"{sub} does not exist on {rev}")
        entries = []
        for name, path in sorted(repo.files[commit].items()):
            meta = self.owner._describe(path)
            entry = {"type": "file", "oid": meta["oid"], "size": meta["size"], "path": name}
            if meta["lfs"]:
                entry["lfs"] = meta["lfs"]
            entries.append(entry)
        self._json(entries)

    def _resolve(self, repo_id: str, rev: str, name: str, head: bool) -> None:
        repo = self._repo(repo_id)
        if repo is None or (commit := self._commit(repo, rev)) is None:
            return
        path = repo.files[commit].get(name)
        if path is None:
            return self._error(404, "EntryNotFound", "Entry not found", {"X-Repo-Commit": commit})
        meta = self.owner._describe(path)
        if meta["lfs"]:
            sha = meta["lfs"]["oid"]
            location = (
                f"{self.owner.cdn_url}/blobs/{sha}/{quote(name)}?X-Amz-Signature=fake&Expires=9999999999"
            )
            body = f"Found. Redirecting to {location}".encode()
            self._status = 302
            self.send_response(302)
            self.send_header("Location", location)
            self.send_header("X-Repo-Commit", commit)
            self.send_header("ETag", f'"{meta["oid"]}"')
            self.send_header("X-Linked-Etag", f'"{sha}"')
            self.send_header("X-Linked-Size", str(meta["size"]))
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)
            return
        self._file(path, head, {"X-Repo-Commit": commit, "ETag": f'"{meta["oid"]}"'})

    def _cdn(self, head: bool) -> None:
        parts = unquote(urlsplit(self.path).path).split("/")
        query = parse_qs(urlsplit(self.path).query)
        path = self.owner.state.blobs.get(parts[2]) if len(parts) >= 3 and parts[1] == "blobs" else None
        if path is None or "X-Amz-Signature" not in query:
            return self._error(403, None, "AccessDenied")
        self._file(path, head, {"ETag": f'"{parts[2]}"'})

    # ------------------------------------------------------------------ uploads

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            self.rfile.readline()
            return b"".join(chunks)
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _upload(self, path: str) -> None:
        body = self._body()
        state, owner = self.owner.state, self.owner
        if path == "/api/repos/create":
            req = json.loads(body)
            repo_id = f"{req['organization']}/{req['name']}" if req.get("organization") else req["name"]
            with state.lock:
                if repo_id not in state.repos:
                    state.repos[repo_id] = Repo({"0" * 40: {}}, {"main": "0" * 40})
            return self._json({"url": f"{owner.url}/{repo_id}", "name": repo_id})
        if (m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/preupload/(.+)", path)) is not None:
            repo = self._repo(m.group(1))
            if repo is None or (commit := self._commit(repo, m.group(2))) is None:
                return
            files = [
                {"path": f["path"], "uploadMode": "lfs" if f["path"].endswith(LFS_SUFFIXES) else "regular",
                 "shouldIgnore": False, "oid": None}
                for f in json.loads(body)["files"]
            ]  # fmt: skip
            return self._json({"files": files, "commitOid": commit})
        if (m := re.fullmatch(r"/([^/]+/[^/]+)\.git/info/lfs/objects/batch", path)) is not None:
            objects = []
            for o in json.loads(body)["objects"]:
                entry = {"oid": o["oid"], "size": o["size"], "authenticated": True}
                if not (owner.uploads / "lfs" / o["oid"]).exists():
                    entry["actions"] = {"upload": {"href": f"{owner.url}/lfs-upload/{o['oid']}"}}
                objects.append(entry)
            return self._json({"transfer": "basic", "objects": objects})
        if (m := re.fullmatch(r"/lfs-upload/([0-9a-f]{64})", path)) is not None:
            if hashlib.sha256(body).hexdigest() != m.group(1):
                return self._error(400, None, "sha256 does not match")
            (owner.uploads / "lfs").mkdir(exist_ok=True)
            (owner.uploads / "lfs" / m.group(1)).write_bytes(body)
            return self._json({})
        if (m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/commit/(.+)", path)) is not None:
            return self._commit_upload(m.group(1), m.group(2), body)
        self._error(404, None, "Not Found")

    def _commit_upload(self, repo_id: str, rev: str, body: bytes) -> None:
        repo = self._repo(repo_id)
        if repo is None or (parent := self._commit(repo, rev)) is None:
            return
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        commit = hashlib.sha1(parent.encode() + body).hexdigest()
        root = self.owner.uploads / commit
        files = dict(repo.files[parent])
        for line in lines:
            value = line["value"]
            if line["key"] not in ("file", "lfsFile"):
                continue
            name = value["path"]
            target = root / name
            if ".." in Path(name).parts or name.startswith("/"):
                return self._error(400, None, f"bad path {name}")
            target.parent.mkdir(parents=True, exist_ok=True)
            if line["key"] == "file":
                target.write_bytes(base64.b64decode(value["content"]))
            else:
                blob = self.owner.uploads / "lfs" / value["oid"]
                if not blob.exists():
                    return self._error(400, None, f"LFS object {value['oid']} was not uploaded")
                shutil.copyfile(blob, target)
            files[name] = target
        with self.owner.state.lock:
            repo.files[commit] = files
            repo.refs[rev] = commit
        self._json({"commitUrl": f"{self.owner.url}/{repo_id}/commit/{commit}", "commitOid": commit,
                    "pullRequestUrl": None})  # fmt: skip

    # ------------------------------------------------------------------ responses

    def _file(self, path: Path, head: bool, extra: dict[str, str]) -> None:
        size = path.stat().st_size
        begin, end, status = 0, size, 200
        want = self.headers.get("Range")
        name = path.name if self.origin == "hub" else self.path.split("?")[0].rsplit("/", 1)[-1]
        fault = None if head else self._fault(name, want is not None and not self.owner.state.ignore_range)
        if fault is not None and fault.status is not None:
            wait = {} if fault.retry_after is None else {"Retry-After": str(fault.retry_after)}
            return self._error(fault.status, None, "injected fault", wait)
        if want and not self.owner.state.ignore_range:
            m = _RANGE.match(want.strip())
            if m is None or int(m.group(1)) >= size:
                self._status = 416
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            begin = int(m.group(1))
            end = min(size, int(m.group(2)) + 1) if m.group(2) else size
            status = 206
            if fault is not None and fault.shift and end < size:
                begin, end = begin + 1, end + 1
        self._status = status
        self.send_response(status)
        for k, v in extra.items():
            self.send_header(k, v)
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(end - begin))
        if status == 206:
            self.send_header("Content-Range", f"bytes {begin}-{end - 1}/{size}")
        self.end_headers()
        if head:
            return
        limit = fault.after if fault is not None and not fault.shift else None
        rate = self.owner.state.rate
        body_started = time.monotonic()
        with open(path, "rb") as f:
            f.seek(begin)
            left = end - begin
            while left:
                if rate:  # the bytes sent so far may not have gone out faster than the rate
                    ahead = self._sent / rate - (time.monotonic() - body_started)
                    if ahead > 0:
                        time.sleep(ahead)
                chunk = f.read(min(left, pace_piece(rate)))
                if limit is not None and self._sent + len(chunk) > limit:
                    self.wfile.write(chunk[: limit - self._sent])
                    self._sent = limit
                    self.wfile.flush()
                    if fault.stall:
                        self.owner.state.stopped.wait(fault.stall)
                    self.close_connection = True
                    self.connection.shutdown(2)  # the peer sees the body end early
                    return
                self.wfile.write(chunk)
                self._sent += len(chunk)
                left -= len(chunk)

    def _path_fault(self, path: str) -> Fault | None:
        with self.owner.state.lock:
            for fault in self.owner.state.faults:
                if fault.times > 0 and fault.path is not None and re.search(fault.path, path):
                    fault.times -= 1
                    return fault
        return None

    def _fault(self, name: str, ranged: bool) -> Fault | None:
        with self.owner.state.lock:
            for fault in self.owner.state.faults:
                if (
                    fault.times > 0
                    and fault.path is None
                    and fault.file == unquote(name)
                    and fault.ranged in (None, ranged)
                ):
                    fault.times -= 1
                    return fault
        return None

    def _json(self, obj: object) -> None:
        body = json.dumps(obj).encode()
        self._status = 200
        self.send_response(200)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
            self._sent = len(body)

    def _error(
        self, status: int, code: str | None, message: str, extra: dict[str, str] | None = None
    ) -> None:
        body = json.dumps({"error": message}).encode()
        self._status = status
        self.send_response(status)
        if code:
            self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
