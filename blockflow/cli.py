"""``blockflow``: the one entry point. ``blockflow --help`` lists the subcommands.

A user's mistake (no server listening, a missing file, malformed JSON, a port in use) ends with
one line on stderr that names the problem and the fix, and an exit code of its own
(:class:`Exit`); a traceback only with ``-v``/``--debug`` (before or after the subcommand).
"""
from __future__ import annotations

import argparse
import enum
import errno
import json
import logging
import os
import socket
import subprocess
import sys
import urllib.error
import warnings
from blockflow.core import settings
from blockflow.blocks import verify
from blockflow.core.protocol import DISPATCHER, ErrorCode


class Exit(enum.IntEnum):
    """Exit codes of the ``blockflow`` command (what a shell script can branch on)."""

    OK = 0
    FAILED = 1           #: the command ran and what it did failed (errors answered, update refused)
    USAGE = 2            #: wrong arguments (argparse's own code)
    NO_FILE = 3          #: a file named on the command line is missing or unreadable
    BAD_INPUT = 4        #: a file or argument is malformed (JSON, shape, ...)
    NO_SERVER = 5        #: nothing answers at the REST URL or dispatcher address
    PORT_TAKEN = 6       #: a port to listen on is in use
    INTERNAL = 70        #: a bug: run again with -v and report the traceback
    INTERRUPTED = 130    #: Ctrl-C
    #: whoever read the output closed the pipe first (``blockflow status --json | head``): the code
    #: of a process killed by SIGPIPE (128 + 13), as ``cat`` or ``yes`` report it, and no message
    CLOSED_PIPE = 141


class UserError(Exception):
    """A mistake the user can fix: ``str(exc)`` says what and how; ``code`` is the exit code."""

    def __init__(self, message: str, code: Exit):
        super().__init__(message)
        self.code = code


def read_json_file(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise UserError(f"{path}: no such file; give the path of a JSON system update "
                        "(e.g. configs/resnet50_shared.json)", Exit.NO_FILE) from None
    except (IsADirectoryError, PermissionError) as exc:
        raise UserError(f"{path}: cannot read it ({exc.strerror})", Exit.NO_FILE) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: not valid JSON ({exc}); fix the file, e.g. check it with "
                        "`python -m json.tool FILE`", Exit.BAD_INPUT) from None


def rest_call(method: str, base: str, path: str, body=None, token: str | None = None):
    """A REST call whose failures are one-line user errors: nobody listening, or the server's message."""
    from .restclient import RestError, call
    try:
        return call(method, base.rstrip("/") + path, body, token, timeout=300)
    except RestError as exc:
        detail = exc.body.get("error", exc.body) if isinstance(exc.body, dict) else exc.body
        named = exc.body.get("field") if isinstance(exc.body, dict) else None
        # the field once: most messages already start with it ("tasks[0].path[1]: names block 'b', ...")
        field = f" (field {named})" if named and not str(detail).startswith(f"{named}:") else ""
        raise UserError(f"the server refused it: HTTP {exc.status}: {detail}{field}", Exit.FAILED) from None
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise UserError(f"no BlockFlow server answers at {base} ({reason}); start one with `blockflow serve` "
                        "or pass --url (or set BLOCKFLOW_URL)", Exit.NO_SERVER) from None


def check_port_free(host: str, port: int, flag: str) -> None:
    """Refuse early, in one line, a port another process listens on (0: any free port, always fine)."""
    if not port:
        return
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise UserError(f"port {port} on {host} is in use (another `blockflow serve`?): stop that "
                                f"process or pass {flag} N ({flag} 0 picks a free port)", Exit.PORT_TAKEN) from None
            if exc.errno == errno.EADDRNOTAVAIL:
                raise UserError(f"{host} is not an address of this machine: fix the host", Exit.BAD_INPUT) from None
            raise


#: The block format `blockflow export` writes unless told: TorchScript, though deprecated upstream, because
#: a block loads in a fraction of a second against seconds for a .pt2 program (README "Block formats").
#: It becomes "export" when the torch pin moves to a release without torch.jit
#: (tests/process/test_format_warnings.py fails until then).
DEFAULT_FORMAT = "torchscript"
#: The input `blockflow export --cut` traces and probes with unless told (batch first).
DEFAULT_INPUT_SHAPE = ",".join(str(d) for d in verify.DEFAULT_INPUT_SHAPE)


def _export(args) -> int:
    if args.cut or args.model not in verify.RESNETS:
        return _export_split(args)
    if args.blocks not in (None, *verify.RESNET_SPLITS):  # refused before torch is imported
        other = f"{args.model}_{args.blocks}"  # not the ResNet export's directory, which a split would rewrite
        raise UserError(f"--blocks {args.blocks}: the ResNet export of {args.model} makes 4 (block1..block4 + head), "
                        f"2 or 1 blocks; to split it otherwise name the cuts (e.g. --cut layer2 --cut layer3 --name "
                        f"{other}) or balance them: --model torchvision.models:{args.model} --blocks {args.blocks} "
                        f"--name {other}", Exit.USAGE)
    from blockflow.blocks.exporter import export_model
    if args.name or args.input_shape != DEFAULT_INPUT_SHAPE:
        raise UserError(f"--name and --input-shape apply to exports with --cut; {args.model} --blocks "
                        f"{args.blocks or 4} is the ResNet export, named {args.model}, input 1,3,224,224", Exit.USAGE)
    blocks = args.blocks or 4
    variants = {}
    if args.variant:
        if not args.variant_blocks:
            raise UserError("--variant needs --variant-blocks (e.g. block4,head)", Exit.USAGE)
        variants[args.variant] = [b.strip() for b in args.variant_blocks.split(",") if b.strip()]
    _make_out_dir(args.out, args.model)
    path = export_model(args.model, args.out, blocks=blocks, method=args.method, variants=variants or None,
                        seed=args.seed, fmt=args.format)
    kind = f"TorchScript, {args.method}" if args.format == "torchscript" else "torch.export programs, .pt2"
    print(f"exported {args.model} ({kind}, {blocks} blocks) -> {path}")
    return 0


def _export_split(args) -> int:
    """Any model (torchvision name or package.module:callable) cut after named submodules."""
    from blockflow.blocks.exporter import export_split
    if args.variant:
        raise UserError("--variant applies to the ResNet export (resnet18/50/152 without --cut)", Exit.USAGE)
    if not args.cut and not args.blocks:
        from blockflow.blocks.split import check_model_name
        check_model_name(args.model)  # a misspelt name first: no cut would help it
        raise UserError(f"--model {args.model}: give where to cut it (--cut LAYER, repeatable) or how many "
                        "blocks to balance (--blocks N)", Exit.USAGE)
    if args.cut and args.blocks:
        raise UserError("give --cut or --blocks, not both: --blocks N picks the N-1 cuts itself", Exit.USAGE)
    if args.input and args.input_shape != DEFAULT_INPUT_SHAPE:
        raise UserError("give --input (each input's name, dtype and dims) or --input-shape (one float32 "
                        "tensor), not both", Exit.USAGE)
    shape = parse_shape(args.input_shape, "--input-shape")
    _make_out_dir(args.out)
    result = export_split(args.model, args.out, cuts=args.cut, blocks=args.blocks, input_shape=shape,
                          name=args.name, fmt=args.format, method=args.method, seed=args.seed,
                          inputs=args.input)
    if not args.cut:
        print(f"balanced cuts: {' '.join('--cut ' + c for c in result['cuts']) or '(none)'}")
    kind = f"TorchScript, {args.method}" if args.format == "torchscript" else "torch.export programs, .pt2"
    print(f"exported {result['name']} ({kind}, {len(result['cuts']) + 1} blocks, cut after "
          f"{', '.join(result['cuts']) or 'nothing'}) -> {result['manifest']}")
    return 0


def _manifest(args) -> int:
    """Write, or with --check verify, the manifest of hand-made block files in a directory."""
    from blockflow.blocks import manifest
    if not os.path.isdir(args.dir):
        raise UserError(f"{args.dir}: no such directory; give the directory that holds your .pt/.pt2 files",
                        Exit.NO_FILE)
    if args.check:
        problems = manifest.check_manifest(args.dir)
        if problems:
            raise UserError(f"{os.path.join(args.dir, 'manifest.json')} does not match the files: "
                            f"{'; '.join(problems)}; if the files are right, run `blockflow manifest "
                            f"{args.dir}` to rewrite it", Exit.FAILED)
        print(f"{os.path.join(args.dir, 'manifest.json')} matches every block file in {args.dir}")
        return 0
    shape = parse_shape(args.input_shape, "--input-shape") if args.input_shape else None
    chain = [c.strip() for c in args.chain.split(",") if c.strip()] if args.chain else None
    if chain and not shape:
        raise UserError("--chain orders the files for probing shapes: give --input-shape too", Exit.USAGE)
    path = manifest.write_manifest(args.dir, shape, chain)
    print(f"wrote {path}" + ("" if shape else " (shapes not probed: give --input-shape to probe them)"))
    return 0


def parse_shape(text: str, flag: str) -> tuple[int, ...]:
    """``"1,3,224,224"`` -> ``(1, 3, 224, 224)``; a UserError naming ``flag`` otherwise."""
    try:
        shape = tuple(int(d) for d in text.split(","))
    except ValueError:
        shape = ()
    if not shape or any(d < 1 for d in shape):
        raise UserError(f"{flag} {text!r}: give positive integers separated by commas, batch first, "
                        "e.g. 1,3,224,224", Exit.BAD_INPUT)
    return shape


def _make_out_dir(out: str, model: str = "") -> None:
    path = os.path.join(out, model) if model else out
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise UserError(f"--out {out}: cannot create {path} ({exc.strerror}); "
                        "choose a directory you can write to", Exit.NO_FILE) from None


def is_loopback(host: str) -> bool:
    import ipaddress
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def _serve(args) -> int:
    check_port_free(args.host, args.port, "--port")
    check_port_free(args.dispatcher_host, args.dispatcher_port, "--dispatcher-port")
    if not os.path.isdir(args.repo):  # every update would fail, each naming a file in it
        where = "" if os.path.isabs(args.repo) else f" (relative to {os.getcwd()})"
        raise UserError(f"--repo {args.repo}: no such directory{where}: export blocks into it first "
                        f"(`blockflow export --model resnet50 --blocks 4 --out {args.repo}`) or pass --repo, "
                        "the directory that holds them", Exit.NO_FILE)
    token = args.token or settings.TOKEN
    exposed = [f"--{opt} {host}" for opt, host in (("host", args.host), ("dispatcher-host", args.dispatcher_host))
               if not is_loopback(host)]
    if exposed and not token and not args.insecure_no_token:
        print(f"blockflow serve: refusing to listen on {' and '.join(exposed)} without a token: anyone who can reach "
              "it could deploy models and send requests. Give --token (or BLOCKFLOW_TOKEN), or pass "
              "--insecure-no-token if the network is trusted.", file=sys.stderr)
        return 2
    if exposed and not token:
        logging.getLogger("blockflow.server").warning(
            "serving WITHOUT a token on %s (--insecure-no-token)", " and ".join(exposed))
    if args.ray:
        try:
            import ray  # noqa: F401 -- only to say what to install before anything starts
        except ImportError:
            print("blockflow serve: --ray needs Ray, which is not installed: pip install -e '.[cluster]' "
                  "(Ray 2.60 or later)", file=sys.stderr)
            return 2
    from blockflow.manager.forkserver import start_early
    start_early()  # its torch import runs beside this process's (next line): ready ~2 s sooner
    from .server import serve
    serve(host=args.host, port=args.port, dispatcher_host=args.dispatcher_host, dispatcher_port=args.dispatcher_port,
          repo=args.repo, state_dir=args.state_dir, token=token, ready_file=args.ready_file, window=args.window,
          quiet=args.quiet, restore=not args.fresh, ray_address=args.ray)
    # A clean stop: the manager stopped every process it started, removed its sockets and slots
    # and recorded the empty state. Skip the interpreter's teardown of torch and the rest (0.5 to
    # 1.5 s on a loaded 2-core machine), which every restart, `make demo` and test waited for,
    # but not multiprocessing's part of it: its exit handler removes the temporary directory the
    # forkserver's socket was in (pymp-*), which os._exit alone left behind, one per run.
    import multiprocessing.util
    multiprocessing.util._exit_function()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


#: ``blockflow load --drain``: seconds the run waits after its window for the replies still due.
#: Without it every synchronous client's last request (sent just before the window ends) was
#: reported unanswered, although the server answered it a request's latency later.
LOAD_DRAIN = 5.0


def _update(args) -> int:
    body = read_json_file(args.file)
    answer = rest_call("POST", args.url, "/system/update", body, args.token or settings.TOKEN)
    print(json.dumps(answer, indent=2) if args.json else format_update(answer))
    return 0


def _names(names) -> str:
    return ", ".join(names) if names else "-"


def format_update(answer: dict) -> str:
    """``blockflow update``'s answer for a person (``--json`` prints it as the server sent it): the
    version, what each process and task became, and whether the TensorMQ slots fit the shared memory."""
    diff = answer.get("diff") or {}
    tasks = diff.get("tasks") or {}
    lines = [f"applied update version {answer.get('version')} in {answer.get('seconds', 0):.2f} s",
             f"processes: spawned {_names(diff.get('spawned'))}; replaced {_names(diff.get('replaced'))}; "
             f"kept {_names(diff.get('kept'))}; removed {_names(diff.get('removed'))}",
             f"tasks: added {_names(tasks.get('added'))}; changed {_names(tasks.get('changed'))}; "
             f"removed {_names(tasks.get('removed'))}"]
    shm = answer.get("shm")
    if shm and shm.get("edges"):
        edges, unknown = shm["edges"], shm.get("edges_unknown_size") or 0
        if unknown == edges:  # no manifest declares the shapes: each slot is sized by its first tensor
            need = f"TensorMQ slots: {edges} edges x {shm['window']} slots, sized by their first tensors"
        else:
            need = f"TensorMQ slots: {shm['needed_bytes_batch1'] / 2**20:.1f} MiB at batch 1 for {edges} edges x " \
                   f"{shm['window']} slots" + (f" ({unknown} of unknown size)" if unknown else "")
        if shm.get("free_bytes") is not None:
            need += f"; {shm['free_bytes'] / 2**20:.0f} MiB free in {os.path.dirname(shm['dir'])}"
        if shm.get("fits") is False:
            need += (": DOES NOT FIT, requests that find no room fail with no_shared_memory (give it more room, "
                     "lower serve --window, or set BLOCKFLOW_SHM_DIR to a larger tmpfs)")
        lines.append(need)
    return "\n".join(fill_line(line) for line in lines)


def fill_line(line: str) -> str:
    """One line of output for a person, wrapped at STATUS_WIDTH on spaces only: a path, a name with a
    hyphen or a URL stays whole, so it can be copied from the terminal."""
    import textwrap
    return textwrap.fill(line, STATUS_WIDTH, subsequent_indent="  ", break_on_hyphens=False,
                         break_long_words=False)


def _status(args) -> int:
    rows = rest_call("GET", args.url, "/status", token=args.token or settings.TOKEN)["processes"]
    system = rest_call("GET", args.url, "/system", token=args.token or settings.TOKEN)
    if args.json:
        print(json.dumps({"version": system.get("version"), "processes": rows, "tasks": system.get("tasks", []),
                          "run_dir": system.get("run_dir")}, indent=2))
        return 0
    print(format_status(rows, system, wide=args.wide))
    return 0


def _down(args) -> int:
    """DELETE /system: every block and task goes; the server keeps running, empty."""
    token = args.token or settings.TOKEN
    tasks = [t["id"] for t in rest_call("GET", args.url, "/system", token=token).get("tasks", [])]
    res = rest_call("DELETE", args.url, "/system", token=token)
    print(f"took the deployment down (version {res.get('version')})")
    for what, names in (("processes", res.get("removed") or []), ("tasks", tasks)):
        print(fill_line(f"removed {what}: {', '.join(names) or '(none)'}"))
    print("the server runs on, empty: `blockflow update FILE` deploys again; stop it with Ctrl-C (SIGTERM)")
    return 0


def _duration(seconds) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def _node(row: dict) -> str:
    """The NODE cell: the host name, or a Ray node id cut to 12 characters, or what it waits for."""
    if row.get("waiting_for_node"):
        return f"(waiting for {row['waiting_for_node']})"
    node = row.get("node") or "-"
    return node[:12] if len(node) == 56 and all(ch in "0123456789abcdef" for ch in node) else node


def _cache_cell(cache) -> str:
    """The CACHE cell: ``resident 1.0MB 12/3`` (hits/misses) for a block of a shared process with
    a memory budget (blocks/cache.py), ``-`` for any other."""
    if not isinstance(cache, dict):
        return "-"
    return f"{cache.get('state')} {cache.get('bytes', 0) / 2**20:.1f}MB {cache.get('hits', 0)}/{cache.get('misses', 0)}"


def _cut(text: str, width: int) -> str:
    """``text`` in ``width`` characters, cut in the middle, so that both ends stay: the block's name
    and its replica (``resnet…al.r1``), a node id's start and end."""
    if len(text) <= width:
        return text
    head = width // 2
    return text[:head] + "…" + text[len(text) - (width - 1 - head):]


def _figure(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


#: The columns of ``blockflow status --wide``, in order, and how each cell is read from a /status row.
STATUS_COLUMNS = {
    "PROCESS": lambda r: str(r["process"]),
    "BLOCK": lambda r: r.get("block") or "-",
    "REPLICA": lambda r: "-" if r.get("replica") is None else str(r["replica"]),
    "GROUP": lambda r: r.get("group") or "-",
    "STATUS": lambda r: str(r["status"]),
    "PID": lambda r: str(r.get("pid") or "-"),
    "NODE": _node,
    "DEVICE": lambda r: str(r.get("device") or "-"),
    "RESTARTS": lambda r: str(r.get("restarts", 0)),
    "UPTIME": lambda r: _duration(r.get("uptime_s")),
    "REQ/S": lambda r: _figure(r.get("requests_per_s")),
    "P50 MS": lambda r: _figure(r.get("p50_ms")),
    "P99 MS": lambda r: _figure(r.get("p99_ms")),
    "ERRORS": lambda r: str(r.get("errors", 0)),
    "NEXT HOPS": lambda r: ",".join(f"{hop}:{kind}" for hop, kind in sorted((r.get("next_hops") or {}).items())) or "-",
    "LAST EXIT": lambda r: r.get("last_exit") or "-",
    "CACHE": lambda r: _cache_cell(r.get("cache")),
}
#: What an operator reads first, the columns of plain ``blockflow status`` (NODE only where the
#: processes run on more than one node, or wait for one). A replica's and a group's block are in
#: the process name (``b2.r1``) and the shared PID; last exits are listed under the table.
STATUS_NARROW = ("PROCESS", "STATUS", "PID", "NODE", "DEVICE", "RESTARTS", "UPTIME", "REQ/S", "P50 MS", "P99 MS",
                 "ERRORS", "CACHE")
#: The width plain ``blockflow status`` fits (``--wide`` does not try).
STATUS_WIDTH = 100


def format_status(rows: list[dict], system: dict, wide: bool = False) -> str:
    """``blockflow status`` for a person: one row per process, then the tasks and the run directory.
    Plain, it fits :data:`STATUS_WIDTH` columns (names too long for it are cut in the middle, "…");
    ``wide`` shows every column and the whole legend."""
    import textwrap
    multi_node = len({r.get("node") for r in rows}) > 1 or any(r.get("waiting_for_node") for r in rows)
    cached = any(r.get("cache") for r in rows)  # a shared process with a memory budget
    heads = [h for h in (STATUS_COLUMNS if wide else STATUS_NARROW)
             if (h != "NODE" or multi_node or wide) and (h != "CACHE" or cached)]
    table = [heads] + [[STATUS_COLUMNS[h](r) for h in heads] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(heads))]
    if not wide:  # too wide: cut the columns of names, the process's last, down to 8 characters each
        excess = sum(widths) + 2 * (len(widths) - 1) - STATUS_WIDTH
        for i in [heads.index(h) for h in ("NODE", "STATUS", "PROCESS") if h in heads]:
            cut = max(0, min(excess, widths[i] - 8))
            widths[i] -= cut
            excess -= cut
        table = [[_cut(c, w) for c, w in zip(row, widths)] for row in table]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table]
    window = max((r.get("window_s") or 0 for r in rows), default=0)
    if wide:
        legend = (f"(REQ/S, P50, P99 and ERRORS over the last {window:.0f} s, or since a younger process was first "
                  "sent requests (each row's window_s in --json); P50/P99 are the block's own "
                  "arrival-to-departure time, the dispatcher's end to end; blocks of one GROUP share one process "
                  "and its PID; NODE is the machine a process runs on; NEXT HOPS says how its tensors travel to "
                  "each next block: handles on one node, bytes with ZeroMQ, tcp (bytes over CURVE TCP) to another "
                  "node)")
        lines += textwrap.wrap(legend, STATUS_WIDTH)
    else:
        lines += [f"last exit of {r['process']}: {r['last_exit']}"[:STATUS_WIDTH] for r in rows if r.get("last_exit")]
        legend = (f"(REQ/S, P50, P99, ERRORS: the last {window:.0f} s or the process's life if shorter; P50/P99: time in the block, end to end for "
                  f"{DISPATCHER}; --wide adds BLOCK, REPLICA, GROUP, NODE, NEXT HOPS, LAST EXIT"
                  + ("; CACHE: a block of a group with a memory budget, resident or parked, its weights, "
                     "hits/misses" if cached else "") + ")")
        lines += textwrap.wrap(legend, STATUS_WIDTH)
    lines.append(f"version {system.get('version')}; tasks:")
    for t in system.get("tasks", []):
        lines += textwrap.wrap(f"{t['id']}: {' -> '.join(t['path'])}", STATUS_WIDTH, initial_indent="  ",
                               subsequent_indent="      ", break_on_hyphens=False)
    if not system.get("tasks"):
        lines.append("  (none: POST an update with `blockflow update FILE`)")
    lines.append(f"run dir: {system.get('run_dir')}")
    return "\n".join(lines)


def _load(args) -> int:
    from .client import BlockFlowError, Client
    from .loadgen import format_summary, run_load
    try:
        shape = tuple(int(s) for s in args.shape.split(","))
    except ValueError:
        raise UserError(f"--shape {args.shape!r}: give integers separated by commas, e.g. 3,224,224",
                        Exit.BAD_INPUT) from None
    if args.duration <= 0 or args.clients < 1 or args.batch < 1 or (args.rate is not None and args.rate <= 0):
        raise UserError("--duration, --clients, --batch and --rate must be positive", Exit.USAGE)
    token = args.token or settings.TOKEN
    with Client(args.address, timeout=3, token=token) as c:  # fail fast: is anybody there?
        try:
            c.ping(timeout=3)
        except (TimeoutError, BlockFlowError) as exc:
            if isinstance(exc, BlockFlowError) and exc.code == "unauthorized":
                raise UserError(f"the dispatcher at {args.address} wants a token: pass --token or set "
                                "BLOCKFLOW_TOKEN", Exit.FAILED) from None
            raise UserError(f"no dispatcher answers at {args.address} within 3 s: start `blockflow serve` "
                            "or pass --address (GET /system shows the dispatcher's)", Exit.NO_SERVER) from None
        _check_load_request(c, args, shape)
    s = run_load(args.address, args.task, clients=args.clients, batch=args.batch, duration=args.duration,
                 rate=args.rate, shape=shape, token=token, timeout=args.timeout, out=args.out, progress=True,
                 drain=args.drain)
    print(format_summary(s))
    return Exit.OK if s["ok"] and not s["errors"] else Exit.FAILED


#: What one request answered before ``blockflow load`` starts makes the whole run pointless: every
#: request of it would get the same answer, for --duration seconds.
LOAD_REFUSALS = {ErrorCode.UNKNOWN_TASK: "the task is not served: check --task against the update's tasks (GET /system)",
                 ErrorCode.BAD_INPUT: "the input does not fit the task: check --shape and --batch against its first block"}


def _check_load_request(client, args, shape: tuple) -> None:
    """One request like the run's before the run: a task no one serves, or an input it does not
    take, stops ``blockflow load`` at once with the dispatcher's message (UserError), instead of
    every request of --duration seconds failing alike. Any other answer, an error or a timeout,
    lets the run start and report it."""
    import torch
    from .client import BlockFlowError
    try:
        client.infer(args.task, torch.zeros((args.batch, *shape)), timeout=args.timeout)
    except BlockFlowError as exc:
        code = ErrorCode.of(exc.code)
        if code in LOAD_REFUSALS:
            raise UserError(f"{code}: {exc} ({LOAD_REFUSALS[code]}); nothing was sent after it",
                            Exit.FAILED) from None
    except TimeoutError:
        pass  # the run will say how many went unanswered


def _kpi(args) -> int:
    from .kpi import blocks_in, failing, format_table, newest_run, plot, summarize_block, without_records
    if args.run_dir is None:  # the running server's own run: where its blocks write now
        args.run_dir = rest_call("GET", args.url, "/system", token=args.token or settings.TOKEN).get("run_dir")
        if not args.run_dir:
            raise UserError(f"the server at {args.url} names no run directory; give the run_dir", Exit.NO_FILE)
        print(f"run of the server at {args.url}: {args.run_dir}", file=sys.stderr)
    if not os.path.isdir(args.run_dir):
        raise UserError(f"{args.run_dir}: no such directory; give a run directory (GET /system shows "
                        "run_dir) or the server's state directory", Exit.NO_FILE)
    run_dir = newest_run(args.run_dir)
    if run_dir is None:
        raise UserError(f"no KPI logs (*.latency.jsonl) in {args.run_dir} or its runs; send some requests "
                        "first, or give the run_dir that GET /system shows", Exit.NO_FILE)
    if run_dir != args.run_dir:
        print(f"newest run: {run_dir}", file=sys.stderr)
    summaries = [summarize_block(run_dir, n, skip=args.warmup) for n in blocks_in(run_dir)]
    print(json.dumps(summaries, indent=2) if args.json else format_table(summaries))
    for line in failing(summaries):
        print(line, file=sys.stderr)
    empty = without_records(summaries)
    if empty:
        print(f"no records yet from block(s) {', '.join(empty)}: they have served no request, or served "
              f"them less than {settings.KPI_FLUSH_INTERVAL:g} s ago (records are written at least that often)",
              file=sys.stderr)
    if args.plot:
        try:
            plot(summaries, args.plot)
        except ImportError:
            raise UserError("--plot needs matplotlib: pip install matplotlib (or the [bench] extra)",
                            Exit.FAILED) from None
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def _demo(args) -> int:
    from .demo import run_demo
    return run_demo(repo=args.repo, config=args.config, requests=args.requests, keep=args.keep)


#: The experiments are not installed with the product: they live in a checkout's experiments/.
EXPERIMENT_NAMES = ["offline_blocks", "rtt", "pipeline_latency", "hop_overhead", "hop_budget", "first_request", "tracing",
                    "batch_scaling", "multiclient", "throughput", "utilization", "energy", "memory_model", "multi_gpu",
                    "kserve_cost", "batching", "fused", "transformers", "replicas", "block_cache", "validation_cost",
                    "peers", "chaos", "fuzz", "soak"]


def _experiments_dir(given: str | None) -> str | None:
    """The checkout holding experiments/: --checkout, else the current directory, else the one this
    package was installed from in editable mode."""
    candidates = [given] if given else [os.getcwd(), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    for root in candidates:
        if os.path.isfile(os.path.join(root, "experiments", "__main__.py")):
            return root
    return None


def _bench(args) -> int:
    root = _experiments_dir(args.checkout)
    if root is None:
        print("blockflow bench: no experiments/ folder found (it ships with a checkout of the repository, not "
              "with the installed package); run it from the checkout or pass --checkout DIR", file=sys.stderr)
        return 2
    cmd = [sys.executable, "-m", "experiments", args.name, *(["--quick"] if args.quick else []),
           *(["--out", args.out] if args.out else [])]
    return subprocess.call(cmd, cwd=root)


def _block(args) -> int:
    from blockflow.blocks.process import main
    return main(["--spec", args.spec])


def _dispatcher(args) -> int:
    from blockflow.dispatcher.process import main
    return main(["--spec", args.spec])


def _build_ext(args) -> int:
    from blockflow.tensormq import outalloc
    if args.check:
        ok = outalloc.load() is not None
        print(f"output-in-slot extension: loaded from {outalloc.build_dir()}" if ok
              else f"output-in-slot extension: not available: {outalloc.why_not()}")
        return 0 if ok else 1
    try:
        outalloc.build(verbose=args.verbose)
    except Exception as exc:  # no compiler, no ninja, no headers: blocks copy their outputs instead
        print(f"blockflow build-ext: the output-in-slot extension was not built ({type(exc).__name__}: {exc}); "
              "blocks will copy their outputs into slots instead", file=sys.stderr)
        return 1 if args.strict else 0
    print(f"built the output-in-slot extension in {outalloc.build_dir()}")
    return 0


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, unless its help already says it or there is none to show."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="blockflow", description=(
        "BlockFlow serves DNNs split into blocks, one process per block, with tensors passed between "
        "processes as shared-memory / CUDA IPC handles (TensorMQ). Typical use: `blockflow export`, "
        "`blockflow serve`, POST an update (`blockflow update`), send tasks (`blockflow load` or "
        "blockflow.Client), read KPIs (`blockflow kpi`)."))
    p.add_argument("-v", "--verbose", "--debug", action="store_true",
                   help="debug logging, and a traceback when something fails (also accepted after the subcommand)")
    p.add_argument("--version", action="version", version=f"blockflow {package_version()}",
                   help="print the installed blockflow version and exit")
    # -v after the subcommand too; SUPPRESS keeps a subcommand from resetting a -v given before it
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", "--debug", action="store_true", default=argparse.SUPPRESS,
                        help="debug logging, and a traceback when something fails")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", required=True)
    _add_parser = sub.add_parser

    def add_parser(name, **kw):
        kw.setdefault("description", kw.get("help"))
        return _add_parser(name, parents=[common], formatter_class=_Help, **kw)
    sub.add_parser = add_parser

    e = sub.add_parser("export", help="split a model into blocks and write them with a manifest of sha256 sums: "
                                      "a torchvision model (seeded weights) or your own, cut after named submodules")
    e.add_argument("--model", default="resnet50", metavar="NAME_OR_CALLABLE",
                   help="a torchvision classification model name (seeded weights, nothing downloaded) or "
                        "package.module:callable returning an nn.Module (imported from the current directory "
                        "or PYTHONPATH)")
    e.add_argument("--cut", action="append", metavar="LAYER",
                   help="split just after this submodule (qualified name, e.g. features.3); repeatable. "
                        "Writes block1..blockK + full")
    e.add_argument("--blocks", type=int, metavar="N",
                   help="resnet18/50/152 without --cut: 4 (block1..block4 + head, the default), 2 (block12, "
                        "block34 + head) or 1 (the full model only); any other model: N blocks, cut where the "
                        "measured block times are most even (the cuts are printed)")
    e.add_argument("--input-shape", default=DEFAULT_INPUT_SHAPE, metavar="SHAPE",
                   help="input the model is traced, probed and timed with, batch first (not for the ResNet export)")
    e.add_argument("--input", action="append", metavar="NAME:DTYPE:DIMS[:LOW..HIGH]",
                   help="one input of forward, in order (repeatable), split on torch.export: e.g. "
                        "input_ids:int64:N,S=2..128 (N the batch, S dynamic within 2..128) and "
                        "attention_mask:int64:N,S:0..1 (integers traced within 0..1; token ids default "
                        "to the embedding's range)")
    e.add_argument("--name", help="directory under --out (default: the model's name, or the callable's)")
    e.add_argument("--format", default=DEFAULT_FORMAT, choices=["torchscript", "export"],
                   help="torchscript: .pt files (torch.jit, deprecated by PyTorch); export: torch.export "
                        f"programs, .pt2 files (default: {DEFAULT_FORMAT}, see README 'Block formats')")
    e.add_argument("--method", default="script", choices=["script", "trace"],
                   help="how TorchScript compiles a block (--format torchscript only)")
    e.add_argument("--out", default="model_repo", help="model repository directory")
    e.add_argument("--variant", help="also export task-specialised copies under this name (another seed; "
                                     "ResNet export only)")
    e.add_argument("--variant-blocks", help="with --variant (ResNet export only): comma-separated blocks to "
                                            "specialise, e.g. block4,head")
    e.add_argument("--seed", type=int, default=0, help="seed of the weights (they are not trained)")
    e.set_defaults(fn=_export)

    mf = sub.add_parser("manifest", help="write (or --check) the manifest.json of your own TorchScript/.pt2 block "
                                          "files in a directory, so the server checks their sha256 before serving")
    mf.add_argument("dir", help="the directory holding the block files (a model directory of the repository)")
    mf.add_argument("--check", action="store_true",
                    help="write nothing: exit 1 naming each file that changed, is missing or is not listed")
    mf.add_argument("--input-shape", metavar="SHAPE", help="probe shapes: run the files in turn on an input of this shape, batch "
                                          "first, e.g. 1,3,224,224 (files named full* take it themselves); "
                                          "default: no shapes listed")
    mf.add_argument("--chain", metavar="FILES", help="comma-separated order of the files for probing (default: natural name "
                                    "order, full* files aside), e.g. stem.pt,body.pt,head.pt")
    mf.set_defaults(fn=_manifest)

    s = sub.add_parser("serve", help="run the REST API, manager, controller and dispatcher")
    s.add_argument("--host", default="127.0.0.1", help="REST bind address (default loopback; others are explicit)")
    s.add_argument("--port", type=int, default=8080, help="REST port (0: any free port)")
    s.add_argument("--dispatcher-host", default="127.0.0.1", help="dispatcher bind address (default loopback)")
    s.add_argument("--dispatcher-port", type=int, default=5580, help="dispatcher port (0: any free port)")
    s.add_argument("--repo", default="model_repo", help="model repository (default: model_repo)")
    s.add_argument("--state-dir", help="sockets, state and KPI runs (default: a private dir under "
                                       "$XDG_RUNTIME_DIR or the temp dir)")
    s.add_argument("--token", help="require this bearer token for every REST call but /health/live and "
                                   "/health/ready, and from clients (or set BLOCKFLOW_TOKEN)")
    s.add_argument("--insecure-no-token", action="store_true",
                   help="allow --host/--dispatcher-host other than loopback without a token (trusted networks only)")
    s.add_argument("--fresh", action="store_true",
                   help="start with no blocks; by default the last update recorded in the state dir's state.json "
                        "is applied again (after a crash or a restart)")
    s.add_argument("--ready-file", help="write the bound addresses here as JSON once serving")
    s.add_argument("--window", type=int, default=settings.WINDOW,
                   help=f"TensorMQ slots in flight per edge (default {settings.WINDOW}, BLOCKFLOW_WINDOW)")
    s.add_argument("--quiet", action="store_true", help="no CherryPy access log on screen")
    s.add_argument("--ray", metavar="ADDRESS",
                   help="place blocks that name a 'node' on the nodes of this Ray cluster ('auto': the one this "
                        "machine belongs to; or host:port of its head): each runs on a node advertising that custom "
                        "resource; hops between nodes travel as bytes over CURVE TCP. Needs the cluster extra: "
                        "pip install -e '.[cluster]'")
    s.set_defaults(fn=_serve)

    u = sub.add_parser("update", help="POST a system update (JSON file) to a running server and print what it "
                                      "changed: the version, the processes spawned, replaced, kept and removed, "
                                      "the tasks, the shared memory its slots need")
    u.add_argument("file", help="the update: blocks and tasks as JSON, e.g. configs/resnet50_shared.json")
    u.add_argument("--url", default=settings.URL, help="the server's REST URL (default: $BLOCKFLOW_URL, else "
                                                       "http://127.0.0.1:8080)")
    u.add_argument("--token", help="bearer token, when the server has one (default: $BLOCKFLOW_TOKEN)")
    u.add_argument("--json", action="store_true", help="print the server's answer as JSON instead (POST "
                                                       "/system/update's body)")
    u.set_defaults(fn=_update)

    st = sub.add_parser("status", help="print a running server's processes as a table (status, pid, device, "
                                       "restarts, uptime, and the last minute's requests/s and p50/p99), its "
                                       "tasks and run directory")
    st.add_argument("--url", default=settings.URL, help="the server's REST URL (default: $BLOCKFLOW_URL, else "
                                                        "http://127.0.0.1:8080)")
    st.add_argument("--token", help="bearer token, when the server has one (default: $BLOCKFLOW_TOKEN)")
    st.add_argument("--json", action="store_true", help="print the same as JSON, for scripts (GET /status rows, "
                                                        "tasks, version, run directory)")
    st.add_argument("--wide", action="store_true", help=f"every column (BLOCK, REPLICA, GROUP, NODE, NEXT HOPS, "
                                                        f"LAST EXIT) and the whole legend; without it the table "
                                                        f"fits {STATUS_WIDTH} columns")
    st.set_defaults(fn=_status)

    dn = sub.add_parser("down", help="take the deployment down: remove every block and task of a running server "
                                     "(DELETE /system) and print what went; the server keeps running, empty")
    dn.add_argument("--url", default=settings.URL, help="the server's REST URL (default: $BLOCKFLOW_URL, else "
                                                        "http://127.0.0.1:8080)")
    dn.add_argument("--token", help="bearer token, when the server has one (default: BLOCKFLOW_TOKEN)")
    dn.set_defaults(fn=_down)

    ld = sub.add_parser("load", help="send requests for a task for --duration seconds (synchronous clients or "
                                     "Poisson arrivals) and print throughput, latency and the server's errors")
    ld.add_argument("--address", default=settings.DISPATCHER,
                    help="the dispatcher's address, as `blockflow serve` prints it (default: $BLOCKFLOW_DISPATCHER, "
                         "else tcp://127.0.0.1:5580)")
    ld.add_argument("--task", required=True, help="task id, as in the update (e.g. classify)")
    ld.add_argument("--clients", type=int, default=1, help="concurrent clients")
    ld.add_argument("--batch", type=int, default=1, help="batch size of each request")
    ld.add_argument("--duration", type=float, default=10.0,
                    help="seconds requests are sent for, whatever the server does")
    ld.add_argument("--drain", type=float, default=LOAD_DRAIN,
                    help="then seconds to wait for the replies still due; a request "
                         "unanswered by then is reported as unanswered. The run lasts --duration + --drain "
                         "at most")
    ld.add_argument("--rate", type=float, help="Poisson arrivals per second in total (default: each client sends "
                                               "its next request when the previous one is answered)")
    ld.add_argument("--shape", default="3,224,224", help="input shape without the batch dimension")
    ld.add_argument("--timeout", type=float, default=30.0, help="deadline per request, seconds")
    ld.add_argument("--token", help="client token (default: BLOCKFLOW_TOKEN)")
    ld.add_argument("--out", help="CSV file for every request's round-trip time")
    ld.set_defaults(fn=_load)

    k = sub.add_parser("kpi", help="per-block latency components and resources from a run's KPI logs")
    k.add_argument("run_dir", nargs="?", help="a run directory (GET /system: run_dir), or a state directory: its "
                                              "newest run (default: the run of the server at --url)")
    k.add_argument("--url", default=settings.URL, help="the server whose current run is read when no run_dir is "
                                                       "given (default: $BLOCKFLOW_URL, else http://127.0.0.1:8080)")
    k.add_argument("--token", help="bearer token, when the server has one (default: $BLOCKFLOW_TOKEN)")
    k.add_argument("--warmup", "--skip", type=int, default=10, dest="warmup",
                   help="drop each block's first N inferences (warm-up)")
    k.add_argument("--json", action="store_true", help="print the summaries as JSON instead of a table")
    k.add_argument("--plot", metavar="FILE.png", help="also draw each block's mean components as stacked bars")
    k.set_defaults(fn=_kpi)

    d = sub.add_parser("demo", help="end to end: serve on free ports, apply an update (--config), send requests "
                                    "to each of its tasks, print latency and per-block KPIs, stop")
    d.add_argument("--repo", default="model_repo", help="model repository (ResNet files the update names are "
                                                        "exported there when missing)")
    d.add_argument("--config", default=None, help="the update to apply (default: configs/resnet50_shared.json, "
                                                  "two tasks sharing ResNet50's block1-3)")
    d.add_argument("--requests", type=int, default=20, help="requests per task, each a 1x3x224x224 tensor")
    d.add_argument("--keep", action="store_true",
                   help="keep the server's state directory (KPI logs under its run directory); removed by default")
    d.set_defaults(fn=_demo)

    b = sub.add_parser("bench", help="run the experiments (experiments/); `all` runs every one",
                       description="Run the thesis's chapter 4 experiments from a checkout's experiments/ folder, "
                                   "each in its own interpreter. Experiments: " + ", ".join(EXPERIMENT_NAMES) + ".")
    b.add_argument("name", choices=[*EXPERIMENT_NAMES, "all"], metavar="NAME",
                   help="experiment name or 'all': " + ", ".join(EXPERIMENT_NAMES))
    b.add_argument("--checkout", help="repository checkout holding experiments/ (default: the current directory)")
    b.add_argument("--quick", action="store_true", help="short settings for a smoke run")
    b.add_argument("--out", help="results directory (default: the git-ignored scratch directory "
                                 "experiments/results/_runs/<machine>); committing results is explicit: "
                                 "--out experiments/results/<machine>")
    b.set_defaults(fn=_bench)

    x = sub.add_parser("build-ext", help="compile the C++ extension that lets a CPU block's model make its output "
                                         "in a TensorMQ slot instead of copying it there (`make install` runs it; "
                                         "without it blocks copy)")
    x.add_argument("--check", action="store_true", help="build nothing: say whether a block would load it (exit 0 "
                                                        "if it would, 1 if not)")
    x.add_argument("--strict", action="store_true", help="exit 1 when the build fails (default: warn and exit 0, "
                                                         "since blocks fall back to copying)")
    x.set_defaults(fn=_build_ext)

    bl = sub.add_parser("block", help="run one block process by hand (the manager normally does)")
    bl.add_argument("--spec", required=True, help="BlockSpec as JSON")
    bl.set_defaults(fn=_block)

    dp = sub.add_parser("dispatcher", help="run the dispatcher by hand (the server normally does)")
    dp.add_argument("--spec", required=True, help="DispatcherSpec as JSON")
    dp.set_defaults(fn=_dispatcher)
    return p


def stdout_is_closed() -> bool:
    """Whether stdout is a pipe (or socket) nobody reads any more: poll reports an error on it."""
    import select
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no fileno (captured), or closed
        return False


def package_version() -> str:
    """The installed distribution's version (pyproject.toml's, as pip recorded it)."""
    from importlib import metadata
    try:
        return metadata.version("blockflow")
    except metadata.PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else settings.LOG_LEVEL,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.jit")
    try:
        try:
            code = int(args.fn(args) or 0)
            sys.stdout.flush()  # here, so that a closed pipe is seen below and not at the interpreter's exit
            return code
        except BrokenPipeError:
            if not stdout_is_closed():  # a socket's EPIPE: an error like any other
                raise
            # The reader went away (`blockflow status --json | head`): nothing is wrong, and nobody
            # reads on. Point stdout at /dev/null so the interpreter's last flush does not fail
            # again (the recipe of Python's signal module docs), and exit quietly.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            return int(Exit.CLOSED_PIPE)
    except UserError as exc:
        if args.verbose:
            logging.getLogger("blockflow.cli").exception("blockflow %s failed", args.cmd)
        print(f"blockflow {args.cmd}: {exc}", file=sys.stderr)
        return int(exc.code)
    except KeyboardInterrupt:
        print(f"blockflow {args.cmd}: interrupted", file=sys.stderr)
        return int(Exit.INTERRUPTED)
    except Exception as exc:
        code, message = explain(exc)
        if args.verbose:
            logging.getLogger("blockflow.cli").exception("blockflow %s failed", args.cmd)
        else:
            message += " (run again with -v for the traceback)" if code == Exit.INTERNAL else ""
        print(f"blockflow {args.cmd}: {message}", file=sys.stderr)
        return int(code)


def explain(exc: Exception) -> tuple[Exit, str]:
    """One line and an exit code for an exception no subcommand turned into a UserError."""
    from blockflow.blocks.verify import BlockFileError
    if isinstance(exc, BlockFileError):
        return Exit.NO_FILE, str(exc)
    if isinstance(exc, FileNotFoundError):
        return Exit.NO_FILE, f"{exc.filename or exc}: no such file or directory"
    if isinstance(exc, PermissionError):
        return Exit.NO_FILE, f"{exc.filename or exc}: permission denied"
    if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
        return Exit.PORT_TAKEN, f"a port is in use ({exc.strerror}): pass another one (0 picks a free port)"
    if isinstance(exc, json.JSONDecodeError):
        return Exit.BAD_INPUT, f"not valid JSON: {exc}"
    if isinstance(exc, ValueError):
        return Exit.BAD_INPUT, str(exc)
    return Exit.INTERNAL, f"unexpected {type(exc).__name__}: {exc}"


if __name__ == "__main__":
    # `python -m blockflow.cli` runs this file as __main__: take main() from the package's module, so
    # that UserError raised by other modules (blockflow.cli.UserError) is the class main() catches.
    from blockflow.cli import main as _package_main
    sys.exit(_package_main())
