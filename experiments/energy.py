"""Energy per inference from NVML power readings (thesis Fig. 4.10). GPU only.

The 4-block ResNet50 (+head) pipeline on the GPU, one synchronous client, batch sizes 1, 2, 4,
8, 16, 32, over ``zeromq`` and ``tensormq``. For every batch size the client sends N requests;
the GPU's energy counter (``nvmlDeviceGetTotalEnergyConsumption``, mJ) is read before and after,
falling back to integrating ``nvmlDeviceGetPowerUsage`` sampled every 0.1 s where the counter is
not supported. Reported: energy per request (per tensor, as the thesis) and per image, both in
total and above the idle power measured for 3 s before the runs. The first min(250, N/4)
requests are sent before the energy window opens (warm-up; min(5, N/4) in --quick).

On the GV100 the thesis measured about 710 mJ per tensor with TensorMQ and 1920 mJ with ZeroMQ
at batch 1 (2.71x), falling with the batch size.

Without a CUDA GPU there is nothing to measure (CPU package power is not what the thesis
reports, and RAPL is not readable in most VMs): the script says so, writes a JSON that records
the skip and why, and exits 0.

    python -m experiments.energy [--quick] [--n N] [--batches 1,2,4,8,16,32]
"""
from __future__ import annotations

import logging
import sys
import time

import torch

from experiments import common

log = logging.getLogger("experiments.energy")

NAME = "energy"
BATCHES = (1, 2, 4, 8, 16, 32)
#: Fig. 4.10 text (GV100, batch 1): mJ per tensor.
THESIS = {"tensormq_batch1_mj": 710.0, "zeromq_batch1_mj": 1920.0}


def skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible (torch.cuda.is_available() is False); energy is read from NVML's GPU " \
               "power and energy counters, so this experiment only runs on a GPU machine"
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception as exc:
        return f"NVML is not usable ({type(exc).__name__}: {exc})"
    return None


class EnergyMeter:
    """Energy of one GPU between ``start()`` and ``stop()``: the NVML counter, else integrated power."""

    def __init__(self, index: int = 0, interval: float = 0.1):
        import threading

        import pynvml
        self.nv = pynvml
        self.h = pynvml.nvmlDeviceGetHandleByIndex(index)
        self.interval = interval
        try:
            pynvml.nvmlDeviceGetTotalEnergyConsumption(self.h)
            self.counter = True
        except Exception:
            self.counter = False
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self):
        while not self._stop.wait(self.interval):
            self.samples.append((time.monotonic(), self.nv.nvmlDeviceGetPowerUsage(self.h) / 1e3))

    def start(self):
        self.t0 = time.monotonic()
        self.e0 = self.nv.nvmlDeviceGetTotalEnergyConsumption(self.h) if self.counter else None
        self._thread.start()
        return self

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(2)
        t1 = time.monotonic()
        if self.counter:
            energy_mj = float(self.nv.nvmlDeviceGetTotalEnergyConsumption(self.h) - self.e0)
        else:
            pts = [(self.t0, self.samples[0][1] if self.samples else 0.0)] + self.samples
            energy_mj = sum((b[0] - a[0]) * (a[1] + b[1]) / 2 for a, b in zip(pts, pts[1:])) * 1e3
        powers = [p for _, p in self.samples]
        return {"seconds": t1 - self.t0, "energy_mj": energy_mj, "source": "counter" if self.counter else "power",
                "mean_power_w": sum(powers) / len(powers) if powers else None}


def idle_power(seconds: float = 3.0) -> float:
    m = EnergyMeter().start()
    time.sleep(seconds)
    r = m.stop()
    return r["energy_mj"] / 1e3 / r["seconds"]


def measure(server, transport: str, batches, n: int, warm: int, p_idle_w: float) -> list[dict]:
    from blockflow.client import Client
    server.update(common.pipeline_update(transport, device="cuda"))
    rows = []
    with Client(server.dispatcher, timeout=300) as c, common.Progress(len(batches) * (n + warm), transport) as bar:
        for b in batches:
            x = common.input_tensor(b, seed=b)
            for _ in range(warm):
                c.infer(common.TASK, x)
                bar.update()
            meter = EnergyMeter().start()
            for _ in range(n):
                c.infer(common.TASK, x)
                bar.update()
            e = meter.stop()
            above_idle = e["energy_mj"] - p_idle_w * e["seconds"] * 1e3
            rows.append({"transport": transport, "batch": b, "n": n, "warmup": warm, **e,
                         "mj_per_request": e["energy_mj"] / n, "mj_per_image": e["energy_mj"] / (n * b),
                         "mj_per_request_above_idle": above_idle / n, "requests_per_s": n / e["seconds"]})
    return rows


def plot(rows: list[dict], out: str, machine: str) -> None:
    plt = common.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for t, color in (("zeromq", "tab:blue"), ("tensormq", "tab:orange")):
        rs = [r for r in rows if r["transport"] == t]
        if not rs:
            continue
        axes[0].plot([r["batch"] for r in rs], [r["mj_per_request"] for r in rs], marker="o", color=color, label=t)
        axes[1].plot([r["batch"] for r in rs], [r["mj_per_image"] for r in rs], marker="o", color=color, label=t)
    axes[0].set_ylabel("mJ per tensor (request)")
    axes[1].set_ylabel("mJ per image")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.legend(fontsize=8)
    fig.suptitle(f"Energy per inference (Fig. 4.10) - {machine}", fontsize=9)
    common.save_fig(fig, out, f"{NAME}_fig4_10.png")


def main(argv=None) -> int:
    ap = common.parser(NAME, __doc__)
    ap.add_argument("--batches", type=lambda s: [int(v) for v in s.split(",") if v],
                    help="comma-separated batch sizes (default 1,2,4,8,16,32)")
    ap.add_argument("--transports", default=",".join(common.TRANSPORTS))
    args = ap.parse_args(argv)
    common.setup_logging(args.verbose)
    batches = args.batches or list(BATCHES)
    transports = [t for t in args.transports.split(",") if t]
    n = args.n or (20 if args.quick else 1000)
    warm = common.warmup_count(n, args.quick)  # sent before each energy window, not counted in it
    settings = {"n": n, "warmup_requests": warm, "batches": batches, "transports": transports, "quick": args.quick,
                "device": "cuda", "energy": "NVML total energy counter (or integrated power) over the N requests"}
    reason = skip_reason()
    env = common.env_info(settings)
    if reason:
        print(f"energy: skipped: {reason}")
        common.write_json(args.out, NAME, {"env": env, "settings": settings, "skipped": True, "reason": reason,
                                           "thesis_gv100": THESIS})
        return 0
    repo = common.ensure_repo(args.repo)
    p_idle = idle_power()
    rows = []
    with common.blockflow_server(repo) as server:
        for t in transports:
            rows += measure(server, t, batches, n, warm, p_idle)
    common.write_json(args.out, NAME, {"env": env, "settings": settings, "skipped": False, "idle_power_w": p_idle,
                                       "rows": rows, "thesis_gv100": THESIS})
    common.write_csv(args.out, f"{NAME}.csv", ["transport", "batch", "n", "seconds", "energy_mj", "mj_per_request",
                                                "mj_per_image", "mj_per_request_above_idle", "mean_power_w"],
                     ([r["transport"], r["batch"], r["n"], r["seconds"], r["energy_mj"], r["mj_per_request"],
                       r["mj_per_image"], r["mj_per_request_above_idle"], r["mean_power_w"]] for r in rows))
    plot(rows, args.out, env["machine"])
    print(f"\nFig. 4.10 on {env['machine']} (idle power {p_idle:.1f} W, n={n} per batch):")
    for r in rows:
        print(f"{r['transport']:9s} batch {r['batch']:3d}: {r['mj_per_request']:9.1f} mJ/tensor "
              f"({r['mj_per_request_above_idle']:9.1f} above idle), {r['mj_per_image']:8.1f} mJ/image, "
              f"{r['requests_per_s']:.1f} req/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
