"""How much room a TensorMQ slot file takes, without torch (the manager sizes an update's
slots before any block starts: manager/state.py ``slot_budget``).

A slot file is a ``HEADER``-byte header (its words: tensormq/shm.py) followed by a data area
of ``round_capacity(nbytes)`` bytes, so that a slot can be reused for a tensor of a similar size.
"""
from __future__ import annotations

import os

#: Bytes of a slot file before its data area (the header words, tensormq/shm.py).
HEADER = 64


def shm_space(directory: str) -> tuple[int, int]:
    """(size, free) of the filesystem holding ``directory``, in bytes."""
    st = os.statvfs(directory)
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def round_capacity(nbytes: int) -> int:
    """Power of two, at least one page, so a slot can be reused across similar sizes."""
    cap = 4096
    while cap < nbytes:
        cap <<= 1
    return cap
