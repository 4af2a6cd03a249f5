"""How a block process's C heap gives memory back to the kernel (glibc malloc).

glibc returns the free memory at the top of the heap to the kernel as soon as it exceeds
``M_TRIM_THRESHOLD`` (dynamic: about twice the largest freed chunk, a few MB for a ResNet50
block). A block frees every activation at the end of a request, so its heap top is trimmed
after every request and the next request takes those pages back one page fault at a time,
each one a zeroed 4 KiB page: measured on the 2-core VM, ResNet50's block1 took ~4,200 minor
faults per request (16 MB) in the served pipeline and a few dozen with the threshold raised
(experiments/pipeline_latency.py ``--variants``). :func:`keep_freed_memory` raises the threshold
once, before the model loads; the cost is that a block keeps up to that many bytes of its peak
activations resident between requests.

Setting ``M_TRIM_THRESHOLD`` also switches off glibc's dynamic mmap threshold, which would leave
every allocation above 128 KiB to its own ``mmap`` (and page faults after every ``munmap``): the
mmap threshold is therefore set as well, to the highest value glibc's dynamic rule would reach
(``MMAP_THRESHOLD``). Tensors above it still get their own mapping.

A shared process (blocks/host.py) runs several blocks' inference threads, and glibc gives each
thread that allocates its own arena: each keeps its own freed activations up to the threshold,
so five blocks in one process held more memory than five processes (experiments/memory_model.py,
``group``). :func:`one_heap` makes them share the main arena; the blocks allocate a few large
tensors per layer, so the arena's lock is not where their time goes.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

#: mallopt() parameter numbers (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
#: glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: the largest value mallopt accepts.
MMAP_THRESHOLD = 32 << 20


def keep_freed_memory(trim_bytes: int) -> bool:
    """Set glibc's ``M_TRIM_THRESHOLD`` to ``trim_bytes`` and ``M_MMAP_THRESHOLD`` to
    ``MMAP_THRESHOLD`` in this process (``trim_bytes`` 0: leave glibc's dynamic defaults). False,
    with a log line, where the C library has no ``mallopt`` or refuses."""
    if not trim_bytes:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        log.info("no mallopt() in this C library: freed heap memory is returned to the kernel at its default")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(M_TRIM_THRESHOLD, min(int(trim_bytes), 2**31 - 1)) == 1
    ok = ok and mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    if not ok:
        log.warning("mallopt(M_TRIM_THRESHOLD, %d) or (M_MMAP_THRESHOLD, %d) was refused; freed heap memory may "
                    "be given back to the kernel after every request", trim_bytes, MMAP_THRESHOLD)
    return ok


def one_heap() -> bool:
    """Every thread of this process allocates from glibc's main arena (``M_ARENA_MAX`` 1). Call it
    before the threads start. False, with a log line, where the C library has no ``mallopt``."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        log.info("no mallopt() in this C library: each thread keeps its own heap arena")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_ARENA_MAX, 1) == 1
