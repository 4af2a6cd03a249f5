"""The skeleton of every process the manager spawns: a block and the dispatcher.

A block (``blockflow.blocks.process``) and the dispatcher (``blockflow.dispatcher.process``)
are subclasses of ``ChildProcess``: each brings its own sockets, its own loop and its own
commands; the life around them is written here once, as gunicorn's ``Worker`` base class does
for its workers. The life of a child, and the exit code each way out of it gives
(``blockflow.core.protocol.ExitCode``; the manager decodes it with ``describe_exit``)::

    manager (parent)                      child
    ----------------                      -----
    spec = BlockSpec(...)                 (pre-spawn: a Struct, nothing touches a process)
    Process(target=SERVE_BLOCK) --fork--> serve(Block, spec)   (an Entry: blocks/spec.py)
                                          1. child = Block(spec): remembers the spec only
                                          2. signals: SIGTERM records itself and asks to stop;
                                             SIGINT is ignored (Ctrl-C is the server's)
                                          3. boot: child.init_process() opens sockets, loads
                                             the model, makes its threads
                                               BootError -> BootFailure   ... exit BOOT_ERROR (3)
                                               anything else                 ... exit CRASH (1)
    controller.wait_ready() <------------ 4. announce: Ready(name, inc, pid, v,
                                             **child.ready_info())
    controller.request(cmd) ------------> 5. loop: the subclass's own (child.loop()); the
                            <----reply--     control socket answers commands by name (below)
                                             until ``stopping`` is set by
                                               the ``stop`` command     -> exit OK (0)
                                               SIGTERM                  -> exit OK (0)
                                               watch_parent(): the manager is gone
                                                                        -> exit ORPHANED (4)
                                               an exception out of the loop -> exit CRASH (1)
                                          6. shutdown(): the order is written in its docstring
    process.exitcode <------------------- 7. exit_with(code): logs and stdio flushed, then
                                             os._exit(code). A value returned by a
                                             multiprocessing target is lost (it exits 0), and
                                             6. has already released what the child owns, so
                                             the interpreter's own teardown is skipped: tearing
                                             down torch's module graph is seconds of CPU on a
                                             loaded machine (a block run by hand took 3 s to go
                                             after "stopped"), as multiprocessing's children
                                             skip it too

The control socket is a DEALER with identity ``<name>#<incarnation>``, connected to the
controller's ROUTER (``blockflow.manager.controller``). A ``Command`` (blockflow/core/protocol.py,
where every control message is declared) is answered by the process's ``cmd_<name>`` method,
found from ``protocol.Cmd`` (every child has ``cmd_ping`` and ``cmd_stop``), with its arguments
typed (``protocol.ARGS``), and answered with a ``Reply``: ``ok`` and its ``result``, or, when it
raises or is unknown, its ``error``; an unknown command's error names the known ones.

One thread owns the control socket: the process's control thread, never its main thread (a
block's runs the model, the dispatcher's moves requests), so that a main thread busy for seconds
still has its pings answered; the manager tells a main thread that is stuck by what the ping says
of it (a block's ``busy_s``, the dispatcher's ``beat_age_s``), not by silence.

Note [Commands for the main loop]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A command that changes what the main thread owns (a topology update, the task table, a block's
failure) is applied by the main thread, between two of its requests: the control thread posts it
to the process's ``Mailbox`` and answers it when the main thread has (``Later``), or with an error
at its deadline; pings go on meanwhile. What the two threads pass are Python objects in two
deques (one process: nothing to encode); a message on a pair of inproc sockets only says "look",
so each thread can wait for it beside its own sockets. The order is append, then signal, on both
sides, and the reader drains the signals before the deque: an item is never left unseen until
the next signal. The main thread checks ``waiting`` between two requests (a block, which waits on
its data socket alone: Note [One wait per hop] in blocks/process.py) or polls ``loop_end`` (the
dispatcher).

This module is the low layer the two roles share: it imports neither of them.
"""
from __future__ import annotations

import argparse
import faulthandler
import importlib
import logging
import os
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, NoReturn

import msgspec
import setproctitle
import zmq

from blockflow.core import settings
from blockflow.core import protocol
from blockflow.core.protocol import BootFailure, Cmd, ExitCode, Ready, Reply, identity
from blockflow.core.header import WireError
from blockflow.core.curve import ClusterKeys, client_of

log = logging.getLogger("blockflow.child")

#: Seconds between two checks that the manager (``spec.parent_pid``) is still there.
PARENT_CHECK_INTERVAL = 1.0
#: Seconds the main thread has to run a command posted by ``on_main_thread`` (a block's between
#: two requests, the dispatcher's loop every 50 ms when idle) before the manager is told that the
#: command failed.
MAIN_THREAD_TIMEOUT = 10.0


class BootError(RuntimeError):
    """The process cannot start; respawning would fail the same way (ExitCode.BOOT_ERROR)."""


class Later:
    """What a command handler returns to answer later: the control thread goes on answering
    others (pings included) meanwhile, and sends the reply with
    ``ChildProcess.answer_command(later.rid, ...)`` once it has one. A process that applies a topology update between two inferences
    stays visibly alive while it waits for the inference to end."""

    __slots__ = ("rid",)

    def __init__(self):
        self.rid = None


class Mailbox:
    """Commands the control thread hands the main thread, and their answers (Note [Commands for
    the main loop]). ``control_end`` is polled by the control thread, ``loop_end`` may be polled
    by the main thread; ``label`` names the process and ``loop`` its main thread in errors."""

    def __init__(self, ctx: zmq.Context, label: str, loop: str):
        self.label, self.loop = label, loop
        address = f"inproc://mailbox-{id(self)}"
        self.loop_end = ctx.socket(zmq.PAIR)
        self.loop_end.linger = 0
        self.loop_end.bind(address)
        self.control_end = ctx.socket(zmq.PAIR)
        self.control_end.linger = 0
        self.control_end.connect(address)
        self._posted: deque = deque()  # (seq, handler, args): appended by the control thread
        self._answered: deque = deque()  # (seq, result, error): appended by the main thread
        #: commands posted and not answered yet: seq -> (Later, deadline, what); control thread only
        self.due: dict[int, tuple[Later, float, str]] = {}
        self._seq = 0
        #: set by the control thread after each post, cleared by the main thread before it reads
        self.waiting = False

    # -- the control thread's side ---------------------------------------------------------------
    def post(self, what: str, handler: Callable, args, timeout: float) -> Later:
        """Have the main thread run ``handler(args)``; answered by ``collect`` or ``expire``."""
        self._seq += 1
        later = Later()
        self.due[self._seq] = (later, time.monotonic() + timeout, what)
        self._posted.append((self._seq, handler, args))
        self.control_end.send(b"")
        self.waiting = True  # after the send: see Note [One wait per hop] in blocks/process.py
        return later

    def collect(self, answer: Callable) -> None:
        """Send the answers the main thread has made: ``answer(rid, result, error=None)``."""
        _drain(self.control_end)
        while self._answered:
            seq, result, error = self._answered.popleft()
            due = self.due.pop(seq, None)
            if due is None:
                continue  # it timed out and was answered with an error already
            later, _deadline, what = due
            if error is None:
                answer(later.rid, result)
            else:
                answer(later.rid, error=f"{self.label} could not apply the {what}: {error}")

    def expire(self, answer: Callable) -> None:
        """Answer with an error every command whose deadline has passed unanswered."""
        now = time.monotonic()
        for seq, (later, deadline, what) in list(self.due.items()):
            if now > deadline:
                del self.due[seq]
                answer(later.rid, error=f"TimeoutError: the {self.loop} of {self.label} did not apply the {what} "
                                        f"in time; it is busy (the ping's busy_s and beat_age_s say for how long)")

    # -- the main thread's side ------------------------------------------------------------------
    def serve(self) -> None:
        """Run every command posted so far and hand back its answer (main thread)."""
        self.waiting = False  # before reading: a command posted meanwhile sets it again
        _drain(self.loop_end)
        done = False
        while self._posted:
            seq, handler, args = self._posted.popleft()
            try:
                self._answered.append((seq, handler(args), None))
            except Exception as exc:  # a bad command is the controller's error, not the process's end
                self._answered.append((seq, None, f"{type(exc).__name__}: {exc}"))
            done = True
        if done:
            self.loop_end.send(b"")


def _drain(sock: zmq.Socket) -> None:
    while True:
        try:
            sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return


class ChildSpec(msgspec.Struct, kw_only=True):
    """What a spec needs to travel to its process as JSON (the ``--spec`` argument), typed both
    ways: a field decodes into its declared type (a block's ``batching`` into a BatchPolicy).
    A child's spec has at least ``controller`` (the control endpoint, None when run by hand),
    ``parent_pid`` (None: no watchdog) and ``incarnation``."""

    def to_json(self) -> str:
        return msgspec.json.encode(self).decode()

    @classmethod
    def from_json(cls, text: str | bytes):
        return msgspec.json.decode(text, type=cls)


@dataclass(frozen=True)
class Entry:
    """A child's entry point, named by its module and function (``blocks/spec.py`` lists them).

    The launcher hands it to the new process as its target: multiprocessing pickles it as two
    strings, and only the child imports the module (the forkserver has it preloaded). So the
    manager starts blocks without importing them, and the control plane stays free of torch;
    the Ray launcher runs ``python -m <module>`` on the block's node instead."""

    module: str
    function: str

    def __call__(self, *args):
        return getattr(importlib.import_module(self.module), self.function)(*args)

    def __str__(self) -> str:
        return f"{self.module}:{self.function}"


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (one we may not signal runs too). A zombie does not: a
    parent that has exited stays one until its own parent reaps it, which an init that does
    not reap orphans (some containers' PID 1) never does, and a child watching it would
    wait forever."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] != b"Z"  # the state, after "(comm)"
    except (OSError, IndexError):  # no /proc (not Linux), or it ended just now
        return os.path.exists(f"/proc/{pid}") or not os.path.isdir("/proc")


class ChildProcess:
    """The base class of a child process; see the module docstring for its life.

    A subclass's ``init_process()`` sets ``ctx`` (its ZeroMQ context), ``transport``, opens the
    control socket with ``open_control()``, makes ``mailbox`` and adds ``control_thread()``
    and its other helper threads to ``threads``; it
    implements ``loop()``, ``ready_info()`` and the shutdown steps (``answer_held``, ``flush``,
    ``close_sockets``, ``files_to_remove``), and a ``cmd_<name>`` method per command it answers."""

    def __init__(self, spec, name: str, label: str, log_tag: str):
        # Pre-spawn or pre-boot: remember, never touch the process (no sockets, no threads).
        self.spec = spec
        #: the name on the control channel (identity ``<name>#<incarnation>``, READY's "name")
        self.name = name
        #: how log lines and errors name this process ("block b1", "dispatcher")
        self.label = label
        #: the ``[tag]`` of every log line of this process
        self.log_tag = log_tag
        #: set once: by the stop command, SIGTERM, the parent watchdog or the end of the loop
        self.stopping = threading.Event()
        self.exit_code = ExitCode.OK
        #: the signal that asked us to stop (recorded by the handler, logged by shutdown)
        self.stop_signal: int | None = None
        self.ctrl: zmq.Socket | None = None
        #: commands for the main thread (Note [Commands for the main loop]); made by init_process
        self.mailbox: Mailbox | None = None
        self.threads: list[threading.Thread] = []
        #: the commands this process answers: every ``Cmd`` it has a ``cmd_<name>`` method for
        self.commands: dict[Cmd, Callable[[msgspec.Struct], object]] = {
            c: handler for c in Cmd if callable(handler := getattr(self, f"cmd_{c.value}", None))}
        self._parent_check_at = 0.0
        #: set once shutdown() has returned (stop_deadline waits for it)
        self.stopped = threading.Event()
        #: when the controller last sent us anything (monotonic); see watch_parent
        self._heard = time.monotonic()

    # -- stopping ------------------------------------------------------------------------------
    def request_stop(self) -> None:
        """Safe from any thread and from a signal handler: only sets a flag, which every loop
        of the process looks at."""
        self.stopping.set()

    def install_signal_handlers(self) -> None:
        def on_term(signum, frame):  # NO LOGGING: only record it; the loop does the work
            self.stop_signal = signum
            self.request_stop()

        signal.signal(signal.SIGTERM, on_term)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's to handle, in order

    def watch_parent(self) -> None:
        """Call it often from a loop; at most every PARENT_CHECK_INTERVAL it checks that the
        manager is still there, and stops this process (ExitCode.ORPHANED) when it is not."""
        now = time.monotonic()
        if now < self._parent_check_at:
            return
        self._parent_check_at = now + PARENT_CHECK_INTERVAL
        pid = self.spec.parent_pid
        if pid and not pid_alive(pid):
            log.warning("%s: manager pid %d is gone; shutting down", self.label, pid)
            self.exit_code = ExitCode.ORPHANED
            self.request_stop()
        # on another node (a TCP controller: Ray mode) the manager's pid means nothing here, and
        # the parent is the node's agent, which a partition does not end: silence does
        if self.ctrl is not None and self.spec.controller.startswith("tcp://") \
                and now - self.last_heard() > settings.CONTROL_LEASE:
            log.warning("%s: nothing from the manager for %.0f s (BLOCKFLOW_CONTROL_LEASE): it gave this "
                        "process up, or cannot reach it; shutting down", self.label, now - self.last_heard())
            self.exit_code = ExitCode.ORPHANED
            self.request_stop()

    def last_heard(self) -> float:
        """When the manager last sent this process anything (monotonic)."""
        return self._heard

    # -- the control channel -------------------------------------------------------------------
    def open_control(self) -> None:
        """The DEALER to the manager's controller; none when the spec names no controller
        (run by hand: tests, benchmarks). Open it last in init_process(), after everything that
        may raise BootError: the boot error goes out with the same identity, which the
        controller accepts from one connection at a time."""
        if not self.spec.controller:
            return
        self.ctrl = self.control_socket(self.ctx)
        self.ctrl.linger = 0

    def control_socket(self, ctx: zmq.Context) -> zmq.Socket:
        """A DEALER connected to the controller with this process's identity; over TCP (a child
        on another node, issue 30) a CURVE client of the cluster's keys (blockflow/core/curve.py)."""
        sock = ctx.socket(zmq.DEALER)
        sock.identity = identity(self.name, self.spec.incarnation)
        keys = ClusterKeys.from_json(getattr(self.spec, "curve", None))
        if keys is not None and self.spec.controller.startswith("tcp://"):
            client_of(sock, keys)
        sock.connect(self.spec.controller)
        return sock

    def announce(self) -> Ready:
        """READY to the controller (from the thread that owns ``ctrl``, before others use it)."""
        msg = Ready(name=self.name, inc=self.spec.incarnation, pid=os.getpid(), **self.ready_info())
        self._heard = time.monotonic()  # pings start once the manager hears this
        if self.ctrl is not None:
            self.ctrl.send(protocol.encode(msg))
        return msg

    def report_boot_error(self, message: str) -> None:
        """Tell the controller why we cannot start, so the REST answer can say it. On a socket of
        its own: init_process() opens the control socket last, after all that can fail."""
        if not self.spec.controller:
            return
        ctx = zmq.Context()
        sock = self.control_socket(ctx)
        sock.linger = 1000
        sock.send(protocol.encode(BootFailure(name=self.name, inc=self.spec.incarnation, pid=os.getpid(),
                                              error=message)))
        sock.close()
        ctx.term()

    def receive_control(self) -> None:
        """Answer every command waiting on ``ctrl`` (call it from the thread that owns it)."""
        while True:
            try:
                raw = self.ctrl.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._heard = time.monotonic()
            try:
                msg = protocol.decode_command(raw)
            except WireError as exc:
                log.warning("%s: ignored a malformed control message (%s)", self.label, exc)
                continue
            try:
                result = self.handle_command(msg.cmd, msg.args)
            except Exception as exc:  # a bad command must not kill the process
                self.answer_command(msg.id, error=f"{type(exc).__name__}: {exc}")
                continue
            if isinstance(result, Later):
                result.rid = msg.id  # the handler's owner answers it (Later)
            else:
                self.answer_command(msg.id, result)

    def answer_command(self, rid, result=None, error: str | None = None) -> None:
        """Answer command ``rid`` (from the thread that owns ``ctrl``)."""
        msg = Reply(rid, False, error=error) if error is not None else Reply(rid, True, result=result)
        self.ctrl.send(protocol.encode(msg))

    def handle_command(self, name: str, args: msgspec.Raw):
        """Run the handler of command ``name`` on its arguments, typed (protocol.ARGS)."""
        try:
            cmd = Cmd(name)
            handler = self.commands[cmd]
        except (ValueError, KeyError):
            raise ValueError(f"unknown command {name!r:.40}; {self.label} knows "
                             f"{', '.join(sorted(c.value for c in self.commands))}") from None
        return handler(protocol.command_args(cmd, args))

    def cmd_ping(self, args: protocol.NoArgs) -> dict:
        return {"pid": os.getpid()}

    # -- the control thread (Note [Commands for the main loop]) ----------------------------------
    def control_thread(self) -> threading.Thread:
        """The thread that will own ``ctrl`` and the mailbox's control end (``init_process``
        makes ``self.mailbox`` and adds this to ``threads``; it starts after READY)."""
        return threading.Thread(target=self.control_loop, name=f"{self.name}-control", daemon=True)

    def control_loop(self) -> None:
        """Answer the controller and watch the manager, until the process stops. It never waits
        on the main thread: a command for it is answered when the mailbox answers (``Later``),
        and pings go on meanwhile."""
        mailbox = self.mailbox
        poller = zmq.Poller()
        poller.register(mailbox.control_end, zmq.POLLIN)
        if self.ctrl is not None:
            poller.register(self.ctrl, zmq.POLLIN)
        try:
            while not self.stopping.is_set():
                events = dict(poller.poll(100))
                if mailbox.control_end in events:
                    mailbox.collect(self.answer_command)
                if self.ctrl is not None and self.ctrl in events:
                    self.receive_control()
                if mailbox.due:
                    mailbox.expire(self.answer_command)
                self.watch_parent()
        except zmq.ContextTerminated:
            pass
        finally:
            if self.ctrl is not None:
                self.ctrl.close(linger=0)
            mailbox.control_end.close(linger=0)
            self.control_ended()

    def on_main_thread(self, what: str, handler: Callable, args, timeout: float = MAIN_THREAD_TIMEOUT) -> Later:
        """What a command handler returns to have ``handler(args)`` run by the main thread
        between two requests (control thread); ``what`` names it in errors."""
        later = self.mailbox.post(what, handler, args, timeout)
        self.wake_main()
        return later

    def wake_main(self) -> None:
        """Make the main thread look at the mailbox soon (a main thread that polls
        ``mailbox.loop_end`` needs nothing more)."""

    def control_ended(self) -> None:
        """The control thread's last step: close what else it owns."""

    # -- how ps, top and py-spy name it ----------------------------------------------------------
    def title(self) -> str:
        """This process's command line as ``ps -f`` and ``py-spy`` show it (``set_title``)."""
        return f"blockflow {self.label}"

    def set_title(self, command_line: bool) -> None:
        """Name this process after its role and name, from its main thread:

        - its short name (comm: ``ps -e``, ``top``; 15 bytes), always: ``bf:<name>``, which the
          threads it starts afterwards inherit (``bf:b2``, ``bf:@dispatcher``, ``bf:@grp``);
        - its command line (``ps -f``, ``top -c``, ``py-spy``) with ``command_line``: a child
          forked from the forkserver shows the forkserver's (``python -c from multiprocessing.
          forkserver import main ...``) otherwise. One started with a command line of its own
          (``python -m blockflow.blocks.process``: by hand, the Ray launcher) keeps that one.

        setproctitle writes the command line over the process's argv (and sets comm to its first
        15 bytes, "blockflow block" for every block: hence the short name set after it)."""
        if command_line:
            setproctitle.setproctitle(self.title())
        setproctitle.setthreadtitle(f"bf:{self.name}")

    def cmd_stop(self, args: protocol.NoArgs) -> dict:
        self.request_stop()
        return {"stopping": True}

    # -- the life ------------------------------------------------------------------------------
    def init_process(self) -> None:
        """In the child: sockets, model, threads. Raise BootError for what a respawn cannot fix."""
        raise NotImplementedError

    def ready_info(self) -> dict:
        """What READY says besides name, incarnation and pid (at least ``endpoint``)."""
        raise NotImplementedError

    def loop(self) -> None:
        """The process's own work, on the main thread, until ``stopping`` is set."""
        raise NotImplementedError

    def run(self) -> int:
        self.announce()
        for t in self.threads:
            t.start()
        if self.owns_process():
            threading.Thread(target=self.stop_deadline, name=f"{self.name}-deadline", daemon=True).start()
        try:
            self.loop()
        finally:
            self.shutdown()
            self.stopped.set()
        return self.exit_code

    def owns_process(self) -> bool:
        """Whether this life is its process's (False: one of several a shared process hosts, whose
        stop deadline is the host's: ending the process would end its neighbours too)."""
        return True

    def stop_deadline(self) -> None:
        """Once the process begins to stop, it has BLOCKFLOW_STOP_DEADLINE to be gone. A stop stuck
        (a thread that never comes back, a socket that will not close) is ended by the manager's
        SIGKILL when a manager is there; an orphan's (its manager or node agent gone: a partition
        that healed) by nothing but this, and it would run on beside its successor. The stacks of
        every thread go to stderr first (the process's log), naming where it was stuck."""
        self.stopping.wait()
        if self.stopped.wait(settings.STOP_DEADLINE):
            return
        log.error("%s: still running %.0f s after it began to stop (BLOCKFLOW_STOP_DEADLINE); its threads "
                  "follow, then it exits (%s)", self.label, settings.STOP_DEADLINE, self.exit_code)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        try:
            abandoned = self.abandoned_files()  # an orphan has no manager to clean up after it
        except Exception:  # noqa: BLE001 (whatever listing them met, the process ends now)
            abandoned = []
        for path in abandoned:
            try:
                os.unlink(path)
            except OSError:
                pass
        os._exit(int(self.exit_code))

    def shutdown(self) -> None:
        """Runs on the main thread once the loop ends (also after an exception). The order matters:

        1. stopping is set: helper threads leave their loops (within 0.1 s) and close the
           sockets they own; every wait for a slot gives up.
        2. ``answer_held()``: every request the process still holds is answered with an error
           and its slot released, through its own sockets: nothing is dropped silently.
        3. ``flush()``: logs are written (after 2, so their last records are in).
        4. helper threads are joined, so no thread uses a socket closed next.
        5. the transport closes: its sockets, and our own slot files are unlinked.
        6. ``close_sockets()``, then the context terminates (not while a helper thread is stuck
           with a socket open: ``term()`` would wait for it forever), then
           ``files_to_remove()`` (socket files, key files) are removed.
        """
        self.stopping.set()
        self.answer_held()
        self.flush()
        for t in self.threads:
            t.join(timeout=2)
        self.transport.close()
        self.close_sockets()
        if any(t.is_alive() for t in self.threads):
            log.warning("%s: a helper thread did not stop; leaving without terminating its sockets", self.label)
        else:
            self.ctx.term()
        for path in self.files_to_remove():
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        why = f", {signal.Signals(self.stop_signal).name}" if self.stop_signal else ""
        log.info("%s stopped (exit %d%s)%s", self.label, self.exit_code, why, self.summary())

    def answer_held(self) -> None:
        """Shutdown step 2: answer what the process still holds (see shutdown())."""

    def flush(self) -> None:
        """Shutdown step 3: write what is logged (see shutdown())."""

    def close_sockets(self) -> None:
        """Shutdown step 6: close the sockets the main thread owns (see shutdown())."""

    def files_to_remove(self) -> list[str]:
        """Shutdown step 6: files of this process to remove last (see shutdown())."""
        return []

    def abandoned_files(self) -> list[str]:
        """What a stop past its deadline removes before it exits (stop_deadline): the files of
        this process that shutdown() would have removed and nothing else will, found without
        taking any lock (a stuck thread may hold it)."""
        return []

    def summary(self) -> str:
        """Said in the last log line, after "stopped (exit N)"."""
        return ""


def serve(cls: type[ChildProcess], spec, forked: bool = False) -> int:
    """Steps 1 to 6 of a child's life (module docstring); returns its exit code. ``forked``: it
    was forked from the forkserver, whose command line it shows until ``set_title`` replaces it."""
    child = cls(spec)
    child.set_title(command_line=forked)
    logging.basicConfig(level=settings.LOG_LEVEL,
                        format=f"%(asctime)s %(levelname)s [{child.log_tag}] %(message)s")
    child.install_signal_handlers()
    try:
        child.init_process()
    except BootError as exc:
        log.error("%s", exc)
        child.report_boot_error(str(exc))
        return ExitCode.BOOT_ERROR
    except Exception:  # a bug, or something a respawn may fix: the manager's restart limit decides
        log.exception("%s crashed while starting", child.label)
        return ExitCode.CRASH
    try:
        return child.run()
    except Exception:
        log.exception("%s crashed", child.label)
        return ExitCode.CRASH


def exit_with(code: int) -> NoReturn:
    """Step 7: end the process with ``code``, spawned by the manager or run by hand. Only after
    shutdown() (or a failed boot, which holds nothing to release): what is buffered is written,
    then the process leaves without the interpreter's teardown (module docstring, step 7)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or gone: nothing left to write there
            pass
    os._exit(int(code))


def spec_from_argv(spec_cls: type[ChildSpec], argv: list[str] | None, prog: str, description: str):
    """The ``--spec JSON`` command line of a child run by hand (``python -m ...``)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--spec", required=True,
                        help=f"the spec as JSON (see {spec_cls.__module__}.{spec_cls.__name__}); '-': read it "
                             "from standard input (a spec with keys in it: never on a command line others can read)")
    text = parser.parse_args(argv).spec
    return spec_cls.from_json(sys.stdin.read() if text == "-" else text)
