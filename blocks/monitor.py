"""Resource sampling for one process: psutil always, pynvml and torch memory on GPUs.

NVML and torch number GPUs differently: NVML sees every GPU of the host, torch only those in
``CUDA_VISIBLE_DEVICES`` and in its own order. The sampler therefore finds its NVML device by
UUID (or PCI bus id), never by torch's index (``nvml_index_for``).

Per-process VRAM comes from NVML's list of compute processes, which names host PIDs. Inside a
PID namespace (a container) this process has another PID, so it is not in the list: the
sample then says why ``vram_mb`` is missing (``vram_unavailable``) instead of leaving it out
silently, and ``torch_reserved_mb`` (the caching allocator's share, without the CUDA context)
is the per-process figure that remains.
"""
from __future__ import annotations

import logging
import os
import time

import psutil
from blockflow.core import settings

log = logging.getLogger(__name__)

#: Seconds between two samples of the monitor thread (thesis: 250 ms).
DEFAULT_INTERVAL = settings.MONITOR_INTERVAL


def _uuid_key(uuid) -> str | None:
    """'GPU-8a1f...-...' (NVML) and '8a1f...-...' (torch) to one comparable form."""
    if uuid is None:
        return None
    text = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
    text = text.strip().lower()
    for prefix in ("gpu-", "mig-"):
        if text.startswith(prefix):
            text = text[len(prefix):]
    return text or None


def _pci_key(bus_id) -> tuple[int, int, int] | None:
    """'00000000:65:00.0' (NVML) and '0000:65:00.0' to (domain, bus, device)."""
    if bus_id is None:
        return None
    text = bus_id.decode() if isinstance(bus_id, bytes) else str(bus_id)
    try:
        domain, bus, rest = text.strip().split(":")
        return int(domain, 16), int(bus, 16), int(rest.split(".")[0], 16)
    except ValueError:
        return None


def nvml_index_for(torch_uuid, torch_pci, nvml_devices: list[dict]) -> int | None:
    """The NVML index of the GPU torch describes by ``torch_uuid`` / ``torch_pci`` (a bus id
    string or (domain, bus, device)); ``nvml_devices``: one dict per NVML index with "uuid" and
    "pci_bus_id". None when nothing matches: never guess by index."""
    want = _uuid_key(torch_uuid)
    if want:
        for i, d in enumerate(nvml_devices):
            if _uuid_key(d.get("uuid")) == want:
                return i
    pci = torch_pci if isinstance(torch_pci, tuple) else _pci_key(torch_pci)
    if pci:
        for i, d in enumerate(nvml_devices):
            if _pci_key(d.get("pci_bus_id")) == pci:
                return i
    return None


def my_pids() -> set[int]:
    """This process's PID in every PID namespace /proc shows (the NSpid line), or just getpid()."""
    pids = {os.getpid()}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    pids.update(int(p) for p in line.split()[1:])
    except (OSError, ValueError):
        pass
    return pids


def process_vram(nvml_procs: list[tuple[int, int | None]], pids: set[int]) -> tuple[float | None, str | None]:
    """(MiB this process holds on the GPU, None) from NVML's (pid, bytes) list, or (None, why not)."""
    for pid, used in nvml_procs:
        if pid in pids:
            if used is None:
                return None, "NVML does not report per-process memory on this GPU (MIG or driver policy)"
            return used / 2**20, None
    if not nvml_procs:
        return None, "NVML lists no compute process on this GPU (no permission to see them?)"
    return None, (f"NVML lists {len(nvml_procs)} compute process(es) on this GPU but not pid "
                  f"{'/'.join(map(str, sorted(pids)))}: this process runs in a PID namespace (a container); "
                  "see torch_reserved_mb")


def _torch_identity(index: int) -> tuple[str | None, tuple[int, int, int] | None]:
    import torch
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    pci = None
    if all(hasattr(props, k) for k in ("pci_domain_id", "pci_bus_id", "pci_device_id")):
        pci = (int(props.pci_domain_id), int(props.pci_bus_id), int(props.pci_device_id))
    return (str(uuid) if uuid is not None else None), pci


class ResourceSampler:
    def __init__(self, device: str = "cpu"):
        self.proc = psutil.Process()
        self.proc.cpu_percent(None)  # the first call only primes the counter
        self.device = device
        self.nvml = None
        self.gpu_index = None
        self.nvml_index = None
        self.pids = my_pids()
        if device.startswith("cuda"):
            try:
                import pynvml
                import torch
                pynvml.nvmlInit()
                self.gpu_index = torch.device(device).index or 0
                uuid, pci = _torch_identity(self.gpu_index)
                devices = []
                for i in range(pynvml.nvmlDeviceGetCount()):
                    h = pynvml.nvmlDeviceGetHandleByIndex(i)
                    devices.append({"uuid": pynvml.nvmlDeviceGetUUID(h),
                                    "pci_bus_id": pynvml.nvmlDeviceGetPciInfo(h).busId})
                self.nvml_index = nvml_index_for(uuid, pci, devices)
                if self.nvml_index is None:
                    raise RuntimeError(f"no NVML device has the UUID {uuid} or PCI bus id {pci} of torch's "
                                       f"{device}")
                self.handle = pynvml.nvmlDeviceGetHandleByIndex(self.nvml_index)
                self.nvml = pynvml
            except Exception as exc:  # NVML missing or no driver: keep the CPU figures
                log.warning("pynvml unavailable for %s (%s); GPU figures will be missing", device, exc)
                self.nvml = None

    def sample(self) -> dict:
        rec = {"ts": time.time(), "cpu_percent": self.proc.cpu_percent(None),
               "rss_mb": self.proc.memory_info().rss / 2**20}
        freq = psutil.cpu_freq()
        if freq is not None:
            rec["cpu_mhz"] = freq.current
        if self.nvml is not None:
            nv, h = self.nvml, self.handle
            try:
                util = nv.nvmlDeviceGetUtilizationRates(h)
                rec.update(gpu_util=util.gpu, gpu_mem_util=util.memory,
                           sm_clock_mhz=nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
                           temp_c=nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU),
                           power_w=nv.nvmlDeviceGetPowerUsage(h) / 1000.0)
                procs = [(p.pid, p.usedGpuMemory) for p in nv.nvmlDeviceGetComputeRunningProcesses(h)]
                vram, why = process_vram(procs, self.pids)
                if vram is not None:
                    rec["vram_mb"] = vram
                else:
                    rec["vram_unavailable"] = why
            except nv.NVMLError as exc:
                rec["nvml_error"] = str(exc)
            import torch
            rec["torch_allocated_mb"] = torch.cuda.memory_allocated(self.gpu_index) / 2**20
            rec["torch_reserved_mb"] = torch.cuda.memory_reserved(self.gpu_index) / 2**20
        return rec
