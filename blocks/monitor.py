"""Resource sampling for one process: psutil always, pynvml and torch memory on GPUs."""
from __future__ import annotations

import logging
import os
import time

import psutil
from blockflow import settings

log = logging.getLogger(__name__)

#: Seconds between two samples of the monitor thread (thesis: 250 ms).
DEFAULT_INTERVAL = settings.MONITOR_INTERVAL


class ResourceSampler:
    def __init__(self, device: str = "cpu"):
        self.proc = psutil.Process()
        self.proc.cpu_percent(None)  # the first call only primes the counter
        self.device = device
        self.nvml = None
        self.gpu_index = None
        if device.startswith("cuda"):
            try:
                import pynvml
                pynvml.nvmlInit()
                import torch
                self.gpu_index = torch.device(device).index or 0
                self.nvml = pynvml
                self.handle = pynvml.nvmlDeviceGetHandleByIndex(self.gpu_index)
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
                pid = os.getpid()
                for p in nv.nvmlDeviceGetComputeRunningProcesses(h):
                    if p.pid == pid and p.usedGpuMemory is not None:
                        rec["vram_mb"] = p.usedGpuMemory / 2**20
            except nv.NVMLError as exc:
                rec["nvml_error"] = str(exc)
            import torch
            rec["torch_allocated_mb"] = torch.cuda.memory_allocated(self.gpu_index) / 2**20
            rec["torch_reserved_mb"] = torch.cuda.memory_reserved(self.gpu_index) / 2**20
        return rec
