"""Helper server processes for the experiments (not BlockFlow itself).

``http``: a CherryPy app with echo endpoints for strings, JSON and tensors (rtt, Table 4.3) and,
with ``--model``, ``POST /infer`` running a whole TorchScript model on tensor bytes sent in the
body (the thesis's "ResNet50 exposed via a REST API", the HTTP* bar of Fig. 4.3); with ``--next URL``
too, ``/infer`` POSTs its output to the next server's /infer and answers with that one's answer,
so that block servers chain over HTTP (the thesis's "split" HTTP version).
``zmq``: a ZeroMQ REP echo server for the same three message kinds.

Each prints one JSON line with its address on stdout when ready and runs until SIGTERM.
:func:`spawn` starts one as a child process and stops it again.

    python -m experiments.servers http [--model resnet50/full.pt --repo model_repo --threads 1] [--next URL]
    python -m experiments.servers zmq
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import warnings

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "int64": torch.int64, "uint8": torch.uint8}


# Received bytes are read-only; the tensors built over them are only read (no copy needed).
warnings.filterwarnings("ignore", message="The given buffer is not writable")


def tensor_from_bytes(buf, shape, dtype: str = "float32") -> torch.Tensor:
    """A tensor over received bytes, without copying them."""
    return torch.frombuffer(buf, dtype=DTYPES[dtype]).view(*shape)


def tensor_bytes(t: torch.Tensor):
    return t.detach().contiguous().view(torch.uint8).reshape(-1).numpy()


def shape_header(t: torch.Tensor) -> str:
    return ",".join(str(s) for s in t.shape)


def parse_shape(text: str) -> list[int]:
    return [int(s) for s in text.split(",") if s]


# -- HTTP (CherryPy) -----------------------------------------------------------------------
def serve_http(model_path: str | None, repo: str | None, threads: int, next_url: str | None = None) -> None:
    import threading

    import cherrypy
    torch.set_num_threads(threads)
    model = None
    if model_path:
        import warnings
        warnings.filterwarnings("ignore", category=FutureWarning)
        from blockflow.blocks.repository import load_block
        model = load_block(repo, model_path, "cpu")
        if os.path.basename(model_path) in ("full.pt", "block1.pt"):  # the others take other shapes
            with torch.inference_mode():
                model(torch.zeros(1, 3, 224, 224))  # warm the model once, as the blocks do
    downstream = threading.local()  # one keep-alive connection to the next server per thread

    def forward(y: torch.Tensor) -> tuple[bytes, dict]:
        if not hasattr(downstream, "client"):
            downstream.client = HttpTensorClient(next_url)
        return downstream.client.post("/infer", memoryview(tensor_bytes(y)), {
            "Content-Type": "application/octet-stream", "X-Shape": shape_header(y), "X-Dtype": "float32"})

    def raw_body() -> bytes:
        return cherrypy.request.body.read()

    class Echo:
        @cherrypy.expose
        def string(self):
            cherrypy.response.headers["Content-Type"] = "text/plain; charset=utf-8"
            return raw_body().decode("utf-8").encode("utf-8")

        @cherrypy.expose
        def json(self):
            cherrypy.response.headers["Content-Type"] = "application/json"
            return json.dumps(json.loads(raw_body())).encode()

        @cherrypy.expose
        def tensor(self):
            req = cherrypy.request
            t = tensor_from_bytes(raw_body(), parse_shape(req.headers["X-Shape"]), req.headers.get("X-Dtype", "float32"))
            cherrypy.response.headers["Content-Type"] = "application/octet-stream"
            cherrypy.response.headers["X-Shape"] = shape_header(t)
            return tensor_bytes(t).tobytes()

    class Root:
        echo = Echo()

        @cherrypy.expose
        def infer(self):
            if model is None:
                raise cherrypy.HTTPError(404, "no model loaded (start with --model)")
            req = cherrypy.request
            t0 = time.perf_counter()
            x = tensor_from_bytes(raw_body(), parse_shape(req.headers["X-Shape"]), req.headers.get("X-Dtype", "float32"))
            t1 = time.perf_counter()
            with torch.inference_mode():
                y = model(x)
            t2 = time.perf_counter()
            inf_ms = (t2 - t1) * 1e3
            cherrypy.response.headers["Content-Type"] = "application/octet-stream"
            cherrypy.response.headers["X-Deser-Ms"] = f"{(t1 - t0) * 1e3:.4f}"
            if next_url:  # the split version: the answer is the rest of the chain's answer
                data, hdr = forward(y)
                cherrypy.response.headers["X-Shape"] = hdr["X-Shape"]
                cherrypy.response.headers["X-Inf-Ms"] = f"{inf_ms + float(hdr.get('X-Inf-Ms', 0.0)):.4f}"
                return data
            cherrypy.response.headers["X-Shape"] = shape_header(y)
            cherrypy.response.headers["X-Inf-Ms"] = f"{inf_ms:.4f}"
            return tensor_bytes(y).tobytes()

    cherrypy.config.update({"server.socket_host": "127.0.0.1", "server.socket_port": 0,
                            "server.thread_pool": 4, "server.max_request_body_size": 1 << 30,
                            "engine.autoreload.on": False, "log.screen": False, "checker.on": False,
                            "environment": "production", "server.socket_timeout": 60})
    cherrypy.tree.mount(Root(), "/", {"/": {"request.show_tracebacks": False}})
    if hasattr(cherrypy.engine, "signal_handler"):
        cherrypy.engine.signal_handler.subscribe()
    cherrypy.engine.start()
    host, port = cherrypy.server.bound_addr[:2]
    print(json.dumps({"url": f"http://{host}:{port}", "pid": os.getpid()}), flush=True)
    cherrypy.engine.block()


# -- ZeroMQ REQ/REP --------------------------------------------------------------------------
def serve_zmq() -> None:
    import zmq
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REP)
    sock.linger = 0
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    stop = []
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
    print(json.dumps({"address": f"tcp://127.0.0.1:{port}", "pid": os.getpid()}), flush=True)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    while not stop:
        if not poller.poll(100):
            continue
        frames = sock.recv_multipart(copy=False)
        kind = frames[0].bytes
        if kind == b"s":
            sock.send_multipart([b"s", frames[1].bytes.decode("utf-8").encode("utf-8")])
        elif kind == b"j":
            sock.send_multipart([b"j", json.dumps(json.loads(frames[1].bytes)).encode()])
        elif kind == b"t":
            meta = json.loads(frames[1].bytes)
            t = tensor_from_bytes(frames[2].buffer, meta["shape"], meta["dtype"])
            sock.send_multipart([b"t", json.dumps({"shape": list(t.shape), "dtype": meta["dtype"]}).encode(),
                                 tensor_bytes(t)], copy=False)
        else:
            sock.send_multipart([b"e", b"unknown kind"])
    sock.close(linger=0)
    ctx.term()


# -- the parent's side ---------------------------------------------------------------------
@contextlib.contextmanager
def spawn(kind: str, *args: str, timeout: float = 120.0):
    """Start ``python -m experiments.servers KIND ARGS``; yield its ready JSON (url/address, pid)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, "-m", "experiments.servers", kind, *args], cwd=root,
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"helper server {kind} exited ({proc.wait(timeout)}) before it was ready")
        yield json.loads(line)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        proc.stdout.close()


class HttpTensorClient:
    """POSTs over one persistent (keep-alive) HTTP/1.1 connection, or over a new connection per
    request with ``new_connection=True`` (what ``requests.post`` without a Session does)."""

    def __init__(self, url: str, timeout: float = 120.0, new_connection: bool = False):
        import http.client
        from urllib.parse import urlparse
        u = urlparse(url)
        self._make = lambda: http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
        self.new_connection = new_connection
        self.conn = self._make()

    def post(self, path: str, body, headers: dict) -> tuple[bytes, dict]:
        if self.new_connection:
            self.conn.close()
            self.conn = self._make()
            headers = {**headers, "Connection": "close"}
        self.conn.request("POST", path, body=body, headers=headers)
        resp = self.conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"POST {path}: HTTP {resp.status}: {data[:200]!r}")
        return data, dict(resp.getheaders())

    def infer(self, x: torch.Tensor, path: str = "/infer") -> tuple[torch.Tensor, dict]:
        data, hdr = self.post(path, memoryview(tensor_bytes(x)), {"Content-Type": "application/octet-stream",
                                                                  "X-Shape": shape_header(x), "X-Dtype": "float32"})
        return tensor_from_bytes(data, parse_shape(hdr["X-Shape"])), hdr

    def close(self):
        self.conn.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.servers", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=["http", "zmq"])
    ap.add_argument("--model", help="model file in the repository for POST /infer, e.g. resnet50/full.pt")
    ap.add_argument("--repo", default=None)
    ap.add_argument("--threads", type=int, default=1, help="torch threads for --model (default 1)")
    ap.add_argument("--next", help="with --model: POST the output to this server's /infer (blocks chained over HTTP)")
    args = ap.parse_args(argv)
    if args.kind == "http":
        serve_http(args.model, args.repo, args.threads, args.next)
    else:
        serve_zmq()
    return 0


if __name__ == "__main__":
    sys.exit(main())
