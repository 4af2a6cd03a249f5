"""A TensorMQ slot file, without torch: how much room it takes and what it is called (the manager
sizes an update's slots before any block starts, and removes the slots of a process that died:
manager/state.py ``slot_budget``, ``remove_slots_of``, ``sweep_orphans``).

A slot file is a ``HEADER``-byte header (its words: tensormq/shm.py) followed by a data area
of ``round_capacity(nbytes)`` bytes, so that a slot can be reused for a tensor of a similar size.
A producer keeps a window of such slots per next hop (``SlotPool``). A slot file is named
``<owner>.<pid>.<seq>`` (``slot_name``): the pool's owner, the process that made it, and a
sequence number unique in that process (a GPU pool's is ``cuda<N>-<k>``).
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


def window_bytes(nbytes: int, window: int) -> int:
    """What one edge's window of slot files takes for a tensor (or message) of ``nbytes``."""
    return window * (HEADER + round_capacity(nbytes))


def slot_name(owner: str, pid: int, seq: str) -> str:
    """The file name of a slot that process ``pid`` makes for pool ``owner``."""
    return f"{owner}.{pid}.{seq}"


def slot_pid(name: str) -> int | None:
    """The process that made the slot file ``name`` (``slot_name``'s pid); None for another file."""
    parts = name.rsplit(".", 2)
    return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None


def slot_files_of(directory: str, pid: int) -> list[str]:
    """The paths of the slot files in ``directory`` that process ``pid`` made (none when the
    directory is gone)."""
    try:
        return [os.path.join(directory, n) for n in os.listdir(directory) if slot_pid(n) == pid]
    except FileNotFoundError:
        return []
