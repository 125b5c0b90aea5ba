"""The object store's stand-in: nginx serving a directory as static files, each answer held back.

nginx answers Range, HEAD, ETag and If-Match natively from the files, and
Debian's Lua module (`libnginx-mod-http-lua`) holds each request in its
access phase with `ngx.sleep(delay)`: a timer on nginx's event loop, so
the wait costs nginx no CPU, as a remote object store's latency costs the
client's machine none. The delay lives in a shared dictionary and is set
through a control location (`NginxStore.delay`), so one store serves a
run's rounds with and without latency.

nginx runs as a child of the benchmark with its own prefix, configuration,
pid file and logs in a temporary directory, on 127.0.0.1 at a free port,
one worker process (the store then takes at most one core's share, and its
CPU is that worker's). Every request is logged with its answer time
(`$msec`) and its duration (`$request_time`): when it arrived and when it
was answered, to the millisecond, for the round trips on the critical path
(`round_trips`, as `LatencySource.round_trips` counts them in process).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.request import urlopen

from unshardfs.testing.latency import round_trips

from .cpu import tree_cpu_seconds

NGINX = "/usr/sbin/nginx"
MODULES = Path("/usr/lib/nginx/modules")
LUA_MODULES = ("ndk_http_module.so", "ngx_http_lua_module.so")
PACKAGES = ("nginx-light", "libnginx-mod-http-lua")
CONTROL = "/.unshardfs-bench-store"  # no dataset has a name like it


class StoreUnavailable(RuntimeError):
    """nginx or its Lua module is missing and could not be installed (the message is one line)."""


def ensure_nginx() -> None:
    """nginx and its Lua module, installed with apt-get (as root) when missing."""
    if _installed():
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise StoreUnavailable(f"the store stand-in needs {' and '.join(PACKAGES)}: install them "
                               f"(apt-get install {' '.join(PACKAGES)}), as root")
    print(f"installing {' '.join(PACKAGES)} (the store stand-in) ...", flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", *PACKAGES]):
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        if done.returncode:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise StoreUnavailable(f"{' '.join(command)} failed ({done.returncode}): {last}")
    if not _installed():
        raise StoreUnavailable(f"{' '.join(PACKAGES)} installed, but {NGINX} or its Lua module is still missing")


def _installed() -> bool:
    return os.access(NGINX, os.X_OK) and all((MODULES / m).exists() for m in LUA_MODULES)


@dataclass(frozen=True)
class StoreRequest:
    """One request as nginx logged it: `start` when it arrived, `end` when it was answered
    (seconds, millisecond resolution, nginx's clock: the epoch)."""

    method: str
    path: str
    range: str | None
    status: int
    sent: int  # body bytes
    start: float
    end: float


_FORMAT = '$msec $request_time $request_method $status $body_bytes_sent "$http_range" $request_uri'

_CONFIG = """\
daemon off;
master_process on;
worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
load_module {modules}/ndk_http_module.so;
load_module {modules}/ngx_http_lua_module.so;
events {{ worker_connections 4096; }}
http {{
    log_format timing '{format}';
    access_log {prefix}/access.log timing;
    client_body_temp_path {prefix}/body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    default_type application/octet-stream;
    keepalive_requests 1000000;
    keepalive_timeout 300s;
    sendfile on;
    tcp_nodelay on;
    lua_shared_dict store 64k;
    server {{
        listen 127.0.0.1:{port} backlog=1024;
        root {root};
        location / {{
            access_by_lua_block {{
                local delay = ngx.shared.store:get("delay")
                if delay and delay > 0 then ngx.sleep(delay) end
            }}
        }}
        location = {control} {{
            access_log off;
            content_by_lua_block {{
                ngx.shared.store:set("delay", tonumber(ngx.var.arg_delay) or 0)
                ngx.say("ok")
            }}
        }}
    }}
}}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class NginxStore:
    """nginx serving `root` on 127.0.0.1, each answer `delay` seconds late (see the module).

    `requests()`, `round_trips()` and `reset_log()` read its access log; `cpu_seconds()` is the
    CPU its processes have used (the master and its worker, reaped children included)."""

    def __init__(self, root: Path, delay: float = 0.0, workdir: Path | None = None) -> None:
        self.root = Path(root).resolve()
        self._delay = delay
        self._workdir = workdir
        self.prefix = Path()
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_start = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "NginxStore":
        ensure_nginx()
        self.prefix = Path(tempfile.mkdtemp(prefix="nginx-", dir=self._workdir))
        try:
            self._start()
            self.delay = self._delay
        except BaseException:
            self.__exit__()
            raise
        return self

    def _start(self) -> None:
        for attempt in range(5):  # the free port may be taken between the probe and nginx's bind
            self.port = free_port()
            conf = self.prefix / "nginx.conf"
            conf.write_text(_CONFIG.format(prefix=self.prefix, modules=MODULES, format=_FORMAT, port=self.port,
                                           root=self.root, control=CONTROL))
            (self.prefix / "error.log").write_text("")
            self.proc = subprocess.Popen([NGINX, "-p", str(self.prefix), "-c", str(conf), "-e",
                                          str(self.prefix / "error.log")],
                                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL, start_new_session=True)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    break
                try:
                    with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                        return
                except OSError:
                    time.sleep(0.02)
            self._stop()
            error = (self.prefix / "error.log").read_text().strip().splitlines()
            if not any("Address already in use" in line for line in error) or attempt == 4:
                raise StoreUnavailable(f"nginx did not start: {error[-1] if error else 'no error logged'}")

    def __exit__(self, *exc: object) -> None:
        self._stop()
        if self.prefix != Path():
            shutil.rmtree(self.prefix, ignore_errors=True)

    def _stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGQUIT)  # graceful: the master waits for its worker
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: the master and its worker
                proc.wait(timeout=10)

    # -- the delay ----------------------------------------------------------------------------

    @property
    def delay(self) -> float:
        return self._delay

    @delay.setter
    def delay(self, seconds: float) -> None:
        with urlopen(f"{self.url}{CONTROL}?delay={seconds!r}", timeout=10) as answer:
            answer.read()
        self._delay = seconds

    # -- the log ------------------------------------------------------------------------------

    def _log_path(self) -> Path:
        return self.prefix / "access.log"

    def reset_log(self) -> None:
        self._settled()
        self._log_start = self._log_path().stat().st_size

    def _settled(self) -> None:
        """Wait until the log stops growing: nginx writes a request's line just after its answer,
        so a client that has all its bytes may look before the last lines are there."""
        path, size = self._log_path(), -1
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            now = path.stat().st_size
            if now == size:
                return
            size = now
            time.sleep(0.02)

    def requests(self, method: str | None = None) -> list[StoreRequest]:
        """The requests logged since `reset_log` (the control location logs none)."""
        self._settled()
        with open(self._log_path(), "rb") as f:
            f.seek(self._log_start)
            lines = f.read().decode("utf-8", "replace").splitlines()
        out = []
        for line in lines:
            msec, took, verb, status, sent, rest = line.split(" ", 5)
            rng, _, path = rest[1:].partition('" ')
            if method is None or verb == method:
                end = float(msec)
                out.append(StoreRequest(verb, path, None if rng == "-" else rng, int(status), int(sent),
                                  end - float(took), end))
        return out

    def round_trips(self) -> int:
        """The longest chain of logged requests each sent after the one before it was answered."""
        return round_trips((r.start, r.end) for r in self.requests())

    # -- its CPU ------------------------------------------------------------------------------

    def cpu_seconds(self) -> float:
        """CPU seconds of nginx's processes so far (utime + stime, with reaped children)."""
        return tree_cpu_seconds(self.proc.pid) if self.proc is not None else 0.0

    def counts(self) -> dict[str, Any]:
        log = self.requests()
        return {"requests": len(log), "round_trips": round_trips((r.start, r.end) for r in log),
                "bytes": sum(r.sent for r in log)}
