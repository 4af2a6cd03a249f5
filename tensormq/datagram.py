"""Headers between processes on one host by Unix datagram, ZeroMQ behind them.

Note [A datagram beside the socket]
-----------------------------------
A TensorMQ message between two processes on this host is one small frame: the header, whose
tensor is a handle (tensormq/shm.py). ZeroMQ carries it through four threads: the sender's
call hands it to the sender's I/O thread, which writes it to the socket; the receiver's I/O
thread reads it and wakes the receiving thread. On the 2-core VM each of those wake-ups costs
more than the message (a bare pyzmq PUSH/PULL relay through two processes: 0.53 ms a round,
1.07 ms after the processes waited 20 ms, as every request through a pipeline's blocks does),
where one ``sendto`` on a Unix datagram socket wakes the receiving thread itself (0.11 and
0.29 ms through the same two processes; /tmp measurements of the twenty-second session).

So every process that binds an ``ipc://`` PULL socket for data (a block, the dispatcher's
result socket) also binds a datagram socket beside it, at the same path with ``.dg`` added
(``path_of``), in the same 0700 socket directory, and waits on both (``Receiver.fileno`` with the
PULL socket in one poll). A sender (``Sender.send``, from ``Transport.send``) tries the datagram
first for a one-frame message to an ``ipc://`` address, never blocking, and goes the ZeroMQ way
whenever it is refused, so ZeroMQ's promises still hold for everything else:

- a full queue (the receiver's, ``net.unix.max_dgram_qlen`` datagrams: 10 on the VM; a burst
  overflows into ZeroMQ, whose high-water mark and send timeout apply as before);
- no receiver (``ENOENT``/``ECONNREFUSED``: not bound yet, or gone): ZeroMQ queues and
  reconnects as before; the datagram is not tried again for ``RETRY_S``;
- a header larger than ``MAX_DATAGRAM`` (payload frames, and every hop to another node, are
  ZeroMQ's anyway).

Both ways end in the same ``admit`` of the receiver, whose checks do not depend on the way a
message came. Order between the two ways is not kept, and need not be: requests are
independent, and a request's own messages follow each other causally. A datagram larger than
the receiver's buffer is cut off by the kernel: ``Receiver.drain`` drops it with a warning (its
requester cannot be named, as ZeroMQ's ``maxmsgsize`` drops an oversized frame).

``BLOCKFLOW_DATAGRAMS=0`` turns it off: no datagram socket is bound or tried.
"""
from __future__ import annotations

import errno
import logging
import os
import secrets
import socket
import time

from blockflow.core import settings

log = logging.getLogger(__name__)

#: Largest header sent by datagram; larger ones go by ZeroMQ (and are refused beyond the limit).
MAX_DATAGRAM = settings.MAX_HEADER_BYTES
#: After a receiver was missing, how long its address goes the ZeroMQ way before a datagram is tried again.
RETRY_S = 1.0
#: Addresses whose datagram path a ``Sender`` remembers (it forgets them all past this).
MAX_ADDRESSES = 256
#: sun_path's size on Linux, the terminating NUL included.
_SUN_PATH = 108
_MISSING = (errno.ENOENT, errno.ECONNREFUSED, errno.ENOTSOCK, errno.EACCES, errno.EPERM)


def path_of(address: str) -> str | None:
    """The datagram socket's path beside the ZeroMQ ``ipc://`` address ``address``; None where
    there is none: another scheme, datagrams off, or a path too long for a Unix socket."""
    if not settings.DATAGRAMS or not address.startswith("ipc://"):
        return None
    path = address[len("ipc://"):] + ".dg"
    return path if len(os.fsencode(path)) < _SUN_PATH else None


class Receiver:
    """The receiving end, bound beside a process's ``ipc://`` PULL socket. Owned by the thread
    that polls it (``fileno`` goes into its zmq.Poller with the PULL socket)."""

    def __init__(self, path: str):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            if not path.startswith("\0") and os.path.lexists(path):
                os.unlink(path)  # left over by a killed predecessor with the same incarnation
            self.sock.bind(path)
        except OSError:
            self.sock.close()
            raise
        self.sock.setblocking(False)
        self._buf = bytearray(MAX_DATAGRAM + 1)
        self._view = memoryview(self._buf)
        #: messages taken, and those dropped for their size
        self.received = self.dropped = 0

    @classmethod
    def beside(cls, address: str, owner: str) -> "Receiver | None":
        """The inbox beside ``address`` (an ``ipc://`` endpoint), or None where it has none or
        cannot bind (then everything comes by ZeroMQ, as senders find no datagram socket)."""
        path = path_of(address)
        if path is None:
            return None
        try:
            return cls(path)
        except OSError as exc:
            log.warning("%s: no datagram socket beside %s (%s): every message comes by ZeroMQ", owner, address, exc)
            return None

    @classmethod
    def unnamed(cls, prefix: str) -> "Receiver":
        """An inbox in Linux's abstract socket namespace (a name no file carries, gone with the
        socket even when its process is killed): for a process that has no directory of its
        own to bind in (a client). Anyone on the host may send to it, so what comes in must be
        checked for who sent it (blockflow/client.py checks a key only its dispatcher knows)."""
        return cls(f"\0{prefix}-{os.getpid()}-{secrets.token_hex(8)}")

    def fileno(self) -> int:
        return self.sock.fileno()

    def stats(self) -> dict:
        return {"received": self.received, "dropped": self.dropped}

    def drain(self, limit: int) -> list[bytes]:
        """Up to ``limit`` waiting messages, without blocking (none when none waits)."""
        out = []
        recv_into, view = self.sock.recv_into, self._view
        while len(out) < limit:
            try:
                n = recv_into(self._buf, 0, socket.MSG_TRUNC)  # MSG_TRUNC: the datagram's own length
            except (BlockingIOError, InterruptedError):
                break
            if n > MAX_DATAGRAM:
                self.dropped += 1
                log.warning("datagram socket %s: dropped a message of %d bytes, more than the %d a header may "
                            "have", self.path, n, MAX_DATAGRAM)
                continue
            out.append(bytes(view[:n]))
        self.received += len(out)
        return out

    def unlink(self) -> None:
        """Remove the socket's file: from now on senders go the ZeroMQ way, while what already
        came can still be drained (a ``sendto`` that found the file has queued its datagram)."""
        if self.path.startswith("\0"):
            return  # an abstract name: no file
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Close and unlink the socket (its file is also in the owner's ``files_to_remove``)."""
        if self.sock.fileno() >= 0:
            self.sock.close()
        self.unlink()


class Sender:
    """The sending end: one unbound datagram socket for every address. Owned by the thread
    that owns the ``Transport``."""

    def __init__(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setblocking(False)
        self._paths: dict[str, str | None] = {}
        self._missing: dict[str, float] = {}  # address -> when to try again
        #: messages sent by datagram, and those the datagram refused (they went by ZeroMQ)
        self.sent = self.refused = 0

    def send(self, address: str, data: bytes) -> bool:
        """Send one frame to ``address`` by datagram; False where it must go by ZeroMQ."""
        path = self._paths.get(address, 0)
        if path == 0:
            if len(self._paths) >= MAX_ADDRESSES:  # addresses come from messages: forged ones must not pile up
                self._paths.clear()
            path = self._paths[address] = path_of(address)
        if path is None:
            return False
        return self.send_to(path, data)

    def send_to(self, path: str, data: bytes) -> bool:
        """Send one frame to the datagram socket at ``path`` (a file, or an abstract name
        starting with NUL); False where it must go another way."""
        if len(data) > MAX_DATAGRAM:
            return False
        if self._missing and path in self._missing:
            if time.monotonic() < self._missing[path]:
                return False
            del self._missing[path]
        try:
            self.sock.sendto(data, path)
        except (BlockingIOError, InterruptedError):
            self.refused += 1  # the receiver's queue is full: ZeroMQ's buffer takes the overflow
            return False
        except OSError as exc:
            self.refused += 1
            if exc.errno not in _MISSING and exc.errno != errno.EMSGSIZE:
                log.warning("datagram to %r failed (%s); it goes by ZeroMQ", path, exc)
            if exc.errno != errno.EMSGSIZE:  # not bound yet, or gone: ZeroMQ queues for it
                if len(self._missing) >= MAX_ADDRESSES:
                    self._missing.clear()
                self._missing[path] = time.monotonic() + RETRY_S
            return False
        self.sent += 1
        return True

    def stats(self) -> dict:
        return {"sent": self.sent, "refused": self.refused}

    def forget(self, address: str) -> None:
        path = self._paths.pop(address, None)
        if path is not None:
            self._missing.pop(path, None)

    def close(self) -> None:
        self.sock.close()
