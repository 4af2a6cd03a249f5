"""What the Open Inference Protocol (KServe v2 REST) costs against BlockFlow's ZeroMQ client.

One server, one task (resnet18 split into 4 blocks + head, CPU, one torch thread per block),
one 1x3x224x224 float32 input. The same request is sent in turns, synchronously, by:

    zeromq       blockflow.Client straight to the dispatcher
    v2_binary    tritonclient[http] to /v2/models/classify/infer, binary-data extension both ways
    v2_json      tritonclient[http] with JSON tensors both ways

The REST process forwards each v2 request to the dispatcher with a blockflow.Client, so the
difference of the medians is what the HTTP hop, the (de)serialisation and the extra process cost.
Turns interleave the three so that load on a shared machine hits them alike.

    python -m experiments.kserve_cost [--quick] [--n N]
"""
from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time

import numpy as np

from experiments import common

log = logging.getLogger("experiments.kserve_cost")
KINDS = ("zeromq", "v2_binary", "v2_json")


def measure(repo: str, n: int) -> dict[str, list[float]]:
    import tritonclient.http as th
    from blockflow.client import Client
    update = common.pipeline_update("tensormq", model="resnet18")
    x = common.input_tensor()
    xn = x.numpy()
    rtts = {k: [] for k in KINDS}
    with common.blockflow_server(repo) as srv:
        srv.update(update)
        triton = th.InferenceServerClient(srv.rest.removeprefix("http://"), network_timeout=60)
        with Client(srv.dispatcher, timeout=60) as zc:
            def v2(binary: bool):
                inp = th.InferInput("input", list(xn.shape), "FP32")
                inp.set_data_from_numpy(xn, binary_data=binary)
                out = th.InferRequestedOutput("output", binary_data=binary)
                return triton.infer(common.TASK, [inp], outputs=[out]).as_numpy("output")
            calls = {"zeromq": lambda: zc.infer(common.TASK, x).numpy(), "v2_binary": lambda: v2(True),
                     "v2_json": lambda: v2(False)}
            want = calls["zeromq"]()
            for k in KINDS:  # the same answer every way
                np.testing.assert_allclose(calls[k](), want, rtol=1e-5, atol=1e-5)
            with common.Progress(n, "kserve_cost") as bar:
                for _ in range(n):
                    for k in KINDS:
                        t0 = time.perf_counter()
                        calls[k]()
                        rtts[k].append((time.perf_counter() - t0) * 1e3)
                    bar.update()
        triton.close()
    return rtts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.kserve_cost", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer requests (smoke run)")
    ap.add_argument("--n", type=int, help="requests per kind (default 100, quick 10)")
    ap.add_argument("--repo", default=common.DEFAULT_REPO, help="model repository (resnet18 is exported there once)")
    ap.add_argument("--out", help="results directory (default experiments/results/<machine>)")
    args = ap.parse_args(argv)
    common.setup_logging()
    n = args.n or (10 if args.quick else 100)
    repo = common.ensure_repo(args.repo, model="resnet18")
    rtts = measure(repo, n)
    summary = {k: common.describe(common.discard_warmup(v, args.quick)) for k, v in rtts.items()}
    base = summary["zeromq"]["p50"]
    for k in KINDS:
        summary[k]["extra_ms_p50"] = summary[k]["p50"] - base
        print(f"{k:10s} median {summary[k]['p50']:8.2f} ms  (+{summary[k]['extra_ms_p50']:.2f} ms vs ZeroMQ client)")
    out = args.out or common.results_dir()
    common.write_json(out, "kserve_cost", {"experiment": "kserve_cost", "env": common.env_info(),
                                                  "settings": {"n": n, "quick": args.quick, "model": "resnet18"},
                                                  "rtt_ms": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
