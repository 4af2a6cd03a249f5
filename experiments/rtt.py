"""Round-trip time of ZeroMQ REQ/REP vs HTTP POST to CherryPy (thesis 4.1.2, Table 4.3).

Two processes talk synchronously over loopback TCP: this one sends a message and waits for the
echo; a helper process (experiments/servers.py) rebuilds the message (decodes the string,
parses the JSON, rebuilds the tensor over the received bytes) and sends it back. Messages:

    string  a 43-byte sentence
    json    configs/resnet50_shared.json (a real system update, ~1 KB)
    tensor  1x256x56x56 float32 (block1's output, 3.2 MB), raw bytes plus shape/dtype

HTTP is measured twice: over one persistent keep-alive connection (``http``, the kindest
setting for HTTP) and with a new TCP connection per request (``http_newconn``, what a plain
``requests.post`` does).
The first min(250, N/4) RTTs are dropped as warm-up (5 in --quick), as in the thesis. N = 5,000
messages per kind and 1,500 tensors by default (the thesis: 10,000 of each; this fits in 1.5
minutes on a 2-core machine). The plot shows the means, as the table does.

    python -m experiments.rtt [--quick] [--n N] [--tensor-n N]
"""
from __future__ import annotations

import gzip
import json
import logging
import os
import sys
import time

import torch

from experiments import common
from experiments.servers import HttpTensorClient, shape_header, spawn, tensor_bytes, tensor_from_bytes

log = logging.getLogger("experiments.rtt")

NAME = "rtt"
KINDS = ("string", "json", "tensor")
STRING = "The quick brown fox jumps over the lazy dog"
TENSOR_SHAPE = (1, 256, 56, 56)
PROTOCOLS = ("zeromq", "http", "http_newconn")
LABELS = {"zeromq": "ZeroMQ REQ/REP", "http": "HTTP POST, keep-alive", "http_newconn": "HTTP POST, new connection"}
THESIS = {"string": (1.676, 0.069), "json": (2.273, 0.106), "tensor": (10.885, 1.054)}  # (HTTP, ZeroMQ) ms


def messages():
    with open(os.path.join(common.ROOT, "configs", "resnet50_shared.json")) as f:
        doc = json.load(f)
    x = torch.randn(TENSOR_SHAPE, generator=torch.Generator().manual_seed(0))
    return {"string": STRING, "json": doc, "tensor": x}


def zmq_rtts(address: str, kind: str, msg, n: int, label: str) -> list[float]:
    import zmq
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.linger = 0
    sock.connect(address)
    out = []
    try:
        with common.Progress(n, label) as bar:
            for _ in range(n):
                t0 = time.perf_counter()
                if kind == "string":
                    sock.send_multipart([b"s", msg.encode("utf-8")])
                    back = sock.recv_multipart()[1].decode("utf-8")
                elif kind == "json":
                    sock.send_multipart([b"j", json.dumps(msg).encode()])
                    back = json.loads(sock.recv_multipart()[1])
                else:
                    sock.send_multipart([b"t", json.dumps({"shape": list(msg.shape), "dtype": "float32"}).encode(),
                                         tensor_bytes(msg)], copy=False)
                    frames = sock.recv_multipart(copy=False)
                    meta = json.loads(frames[1].bytes)
                    back = tensor_from_bytes(frames[2].buffer, meta["shape"], meta["dtype"])
                out.append((time.perf_counter() - t0) * 1e3)
                bar.update()
        _check(kind, msg, back)
    finally:
        sock.close(linger=0)
        ctx.term()
    return out


def http_rtts(url: str, kind: str, msg, n: int, label: str, new_connection: bool = False) -> list[float]:
    client = HttpTensorClient(url, new_connection=new_connection)
    out = []
    try:
        with common.Progress(n, label) as bar:
            for _ in range(n):
                t0 = time.perf_counter()
                if kind == "string":
                    data, _ = client.post("/echo/string", msg.encode("utf-8"),
                                          {"Content-Type": "text/plain; charset=utf-8"})
                    back = data.decode("utf-8")
                elif kind == "json":
                    data, _ = client.post("/echo/json", json.dumps(msg).encode(), {"Content-Type": "application/json"})
                    back = json.loads(data)
                else:
                    data, hdr = client.post("/echo/tensor", memoryview(tensor_bytes(msg)),
                                            {"Content-Type": "application/octet-stream", "X-Shape": shape_header(msg),
                                             "X-Dtype": "float32"})
                    back = tensor_from_bytes(data, [int(s) for s in hdr["X-Shape"].split(",")])
                out.append((time.perf_counter() - t0) * 1e3)
                bar.update()
        _check(kind, msg, back)
    finally:
        client.close()
    return out


def _check(kind, sent, back):
    ok = torch.equal(sent, back) if kind == "tensor" else sent == back
    if not ok:
        raise AssertionError(f"{kind}: the echo differs from what was sent")


def plot(rows: list[dict], out: str) -> None:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.4))
    protos = [p for p in PROTOCOLS if any(r["protocol"] == p for r in rows)]
    width = 0.8 / len(protos)
    for k, proto in enumerate(protos):
        rs = [next(r for r in rows if r["protocol"] == proto and r["kind"] == kind) for kind in KINDS]
        xs = [i + (k - (len(protos) - 1) / 2) * width for i in range(len(KINDS))]
        bars = ax.bar(xs, [r["rtt_ms"]["mean"] for r in rs], width, label=LABELS[proto])  # the table's means
        ax.bar_label(bars, fmt="%.3f", fontsize=7)
    ax.set_xticks(range(len(KINDS)), KINDS)
    ax.set_yscale("log")
    ax.set_ylabel("mean RTT (ms, log scale)")
    ax.set_xlabel("message type")
    ax.set_title("RTT by message type (Table 4.3)")
    ax.legend(fontsize=8)
    common.save_fig(fig, out, "rtt.png")


def main(argv=None) -> int:
    ap = common.parser(NAME, __doc__)
    ap.add_argument("--tensor-n", type=int, help="messages for the tensor kind (default 1500; with --n or --quick: the same)")
    args = ap.parse_args(argv)
    common.setup_logging(args.verbose)
    torch.set_num_threads(1)
    # the thesis: 10,000 messages per kind; here 5,000 (1,500 tensors) so the run fits in 1.5 minutes
    n = args.n or (50 if args.quick else 5000)
    n_tensor = args.tensor_n or (n if args.n or args.quick else 1500)
    msgs = messages()
    settings = {"n": n, "n_tensor": n_tensor, "warmup_dropped": {k: common.warmup_count(n_tensor if k == "tensor" else n,
                                                                                        args.quick) for k in KINDS},
                "string_bytes": len(STRING.encode()), "json_bytes": len(json.dumps(msgs["json"]).encode()),
                "tensor_shape": list(TENSOR_SHAPE), "tensor_bytes": msgs["tensor"].numel() * 4,
                "transport": "loopback TCP for both; HTTP over one keep-alive connection", "quick": args.quick}
    env = common.env_info(settings)
    rows, raw = [], {}
    with spawn("zmq") as z, spawn("http") as h:
        for kind in KINDS:
            count = n_tensor if kind == "tensor" else n
            for proto in PROTOCOLS:
                if proto == "zeromq":
                    vals = zmq_rtts(z["address"], kind, msgs[kind], count, f"{proto} {kind}")
                else:
                    vals = http_rtts(h["url"], kind, msgs[kind], count, f"{proto} {kind}", proto == "http_newconn")
                raw[(proto, kind)] = vals
                kept = common.discard_warmup(vals, args.quick)
                rows.append({"protocol": proto, "kind": kind, "n": count, "dropped": count - len(kept),
                             "rtt_ms": common.describe(kept)})
    summary = []
    for kind in KINDS:
        z = next(r for r in rows if r["protocol"] == "zeromq" and r["kind"] == kind)["rtt_ms"]
        h = next(r for r in rows if r["protocol"] == "http" and r["kind"] == kind)["rtt_ms"]
        hn = next(r for r in rows if r["protocol"] == "http_newconn" and r["kind"] == kind)["rtt_ms"]
        summary.append({"http_newconn_mean_ms": hn["mean"], "http_newconn_p50_ms": hn["p50"],
                        "ratio_newconn_mean": hn["mean"] / z["mean"], "kind": kind, "http_mean_ms": h["mean"], "zeromq_mean_ms": z["mean"],
                        "ratio_mean": h["mean"] / z["mean"], "http_p50_ms": h["p50"], "zeromq_p50_ms": z["p50"],
                        "ratio_p50": h["p50"] / z["p50"], "thesis_http_ms": THESIS[kind][0],
                        "thesis_zeromq_ms": THESIS[kind][1], "thesis_ratio": THESIS[kind][0] / THESIS[kind][1]})
    common.write_json(args.out, NAME, {"env": env, "settings": settings, "rows": rows, "table_4_3": summary})
    path = os.path.join(common.results_dir(args.out), f"{NAME}_raw.csv.gz")
    with gzip.open(path, "wt") as f:
        f.write("protocol,kind,i,rtt_ms\n")
        for (proto, kind), vals in raw.items():
            f.writelines(f"{proto},{kind},{i},{v:.4f}\n" for i, v in enumerate(vals))
    print(f"wrote {path}")
    plot(rows, args.out)
    print(f"\nTable 4.3 on {env['machine']} (n={n}, tensor n={n_tensor}; first {settings['warmup_dropped']['string']} "
          "dropped):")
    print(f"{'data type':10s} {'HTTP mean':>10s} {'ZMQ mean':>9s} {'ratio':>6s} {'HTTP p50':>9s} {'ZMQ p50':>8s} "
          f"{'ratio':>6s} {'HTTP-newconn mean':>17s} {'ratio':>6s}   thesis (awenode): HTTP / ZMQ / ratio")
    for s in summary:
        print(f"{s['kind']:10s} {s['http_mean_ms']:10.3f} {s['zeromq_mean_ms']:9.3f} {s['ratio_mean']:5.1f}x "
              f"{s['http_p50_ms']:9.3f} {s['zeromq_p50_ms']:8.3f} {s['ratio_p50']:5.1f}x "
              f"{s['http_newconn_mean_ms']:17.3f} {s['ratio_newconn_mean']:5.1f}x   "
              f"{s['thesis_http_ms']:.3f} / {s['thesis_zeromq_ms']:.3f} / {s['thesis_ratio']:.0f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
