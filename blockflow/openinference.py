"""The Open Inference Protocol (KServe v2, REST) in front of the dispatcher.

    GET  /v2                                  server metadata (name, version, extensions)
    GET  /v2/health/live                      200 while the server answers
    GET  /v2/health/ready                     200 when the dispatcher and every block are ready
    GET  /v2/models/{task}[/versions/1]       inputs and outputs: name, datatype, shape (-1: any)
    GET  /v2/models/{task}[/versions/1]/ready 200 when the task can be served now
    POST /v2/models/{task}[/versions/1]/infer input tensors in, output tensors out

A model is a task; its one version is "1". A task whose first block takes several tensors has
inputs ``input_0``, ``input_1``, ... (its manifest's ``input_shapes``); one whose last block
returns several has outputs ``output_0``, ... for a tuple, or the dict's keys (tensormq/bundle.py).
A request names its inputs as the metadata lists them, each once, in any order; any other name is
refused with 400 (a block no manifest describes takes ``input``, or ``input_0``, ... for several).
Tensors travel as JSON (``data``: the values, flattened or in nested lists) or with the
binary-data extension (``Inference-Header-Content-Length``: the JSON header, then the raw
little-endian row-major bytes of each input whose ``parameters.binary_data_size`` says how
many). The REST process forwards each request to the dispatcher with BlockFlow's own
``Client`` (one per process, thread-safe), so the tensor takes the same path as any client's.
With a token configured, infer is a POST like the others: ``Authorization: Bearer <token>``.

This runs in the control plane's process, which stays without torch until the first infer
request (every other route reads metadata only): that request imports torch for the tensors and
the client, about 2 s of CPU once, instead of every ``blockflow serve`` paying it at start.
"""
from __future__ import annotations

import json
import logging
import math
import os
import threading
from typing import TYPE_CHECKING

import cherrypy

from blockflow.core import settings
from blockflow.core.protocol import ErrorCode

if TYPE_CHECKING:
    import torch

log = logging.getLogger("blockflow.openinference")

#: KServe datatype <-> the name of its torch dtype (BYTES, i.e. strings, has no tensor counterpart here).
DATATYPES = {"BOOL": "bool", "UINT8": "uint8", "INT8": "int8", "INT16": "int16", "INT32": "int32",
             "INT64": "int64", "FP16": "float16", "FP32": "float32", "FP64": "float64", "BF16": "bfloat16"}
TORCH_TO_DATATYPE = {v: k for k, v in DATATYPES.items()}
MANIFEST_DTYPES = {"float32": "FP32", "float16": "FP16", "bfloat16": "BF16", "float64": "FP64",
                   "uint8": "UINT8", "int64": "INT64", "int32": "INT32"}
MAX_TENSOR_BYTES = settings.MAX_TENSOR_BYTES
_NOT_SERVED = object()  # V2._declared_inputs: no such task now
#: Largest request body: the largest tensor the data plane takes plus room for the JSON header.
MAX_BODY = MAX_TENSOR_BYTES + (1 << 20)
#: HTTP status for the error codes a BlockFlow client can get.
STATUS = {ErrorCode.BAD_REQUEST: 400, ErrorCode.BAD_INPUT: 400, ErrorCode.UNKNOWN_TASK: 404,
          ErrorCode.UNAUTHORIZED: 401, ErrorCode.OVERLOADED: 503, ErrorCode.UNAVAILABLE: 503,
          ErrorCode.SHUTDOWN: 503, ErrorCode.TIMEOUT: 504, ErrorCode.DISCONNECTED: 502,
          ErrorCode.BLOCK_FAILED: 502, ErrorCode.BAD_RESULT: 502}


def fail(code: int, message: str):
    from blockflow.rest import fail as rest_fail
    rest_fail(code, message)


def declared_tensors(entry: dict | None, what: str) -> list[tuple[str, list[int]]]:
    """(name, shape) of each ``what`` ("input" or "output") a manifest entry declares, as
    GET /v2/models/{task} lists them (-1: any size): ``input``/``output`` for one tensor,
    ``input_0``, ... or the output dict's keys for several (the model's input names where the
    entry has them); one of any shape without an entry.  A dynamic dimension (the entry's
    ``input_dims``/``output_dims``) is -1 too."""
    entry = entry or {}
    named = entry.get(f"{what}_dims") or []

    def dims(d, i=0):
        if not (isinstance(d, list) and d):
            return [-1]
        dynamic = named[i] if i < len(named) else []
        return [-1, *(-1 if j < len(dynamic) and not isinstance(dynamic[j], int) else s
                      for j, s in enumerate(d) if j)]

    shapes = entry.get(f"{what}_shapes")
    if not shapes:
        return [(what, dims(entry.get(f"{what}_shape")))]
    names = entry.get("output_keys" if what == "output" else "input_names")
    names = names or [f"{what}_{i}" for i in range(len(shapes))]
    return [(n, dims(d, i)) for i, (n, d) in enumerate(zip(names, shapes))]


def declared_dtypes(entry: dict | None, what: str) -> list[str]:
    """The Open Inference Protocol datatype of each ``what`` a manifest entry declares (in the
    order of :func:`declared_tensors`): every member's where it records them
    (``input_dtypes``/``output_dtypes``), else the entry's one ``dtype`` (FP32 without)."""
    entry = entry or {}
    count = len(declared_tensors(entry, what))
    dtypes = entry.get(f"{what}_dtypes") or [entry.get("dtype")] * count
    return [TORCH_TO_DATATYPE.get(d, "FP32") for d in dtypes]


def _name_list(names: list) -> str:
    """``input 'a'`` or ``inputs 'a', 'b'``, for an error message."""
    shown = ", ".join(repr(n) if isinstance(n, str) and len(n) <= 40 else _show(n) for n in names[:8])
    more = f" and {len(names) - 8} more" if len(names) > 8 else ""
    return f"input{'s' if len(names) != 1 else ''} {shown or 'none'}{more}"


def _show(value) -> str:
    """A JSON value of a request, short, for an error message."""
    if isinstance(value, dict):
        return "an object"
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:40] + "..."


def why_not_values(data: list, datatype: str) -> str:
    """Why ``torch.tensor`` refused ``data``, in the protocol's words instead of torch's or
    numpy's: the first entry that is not a number, nested lists that are not regular (an entry
    unlike the first one at its depth), else a value out of the datatype's range."""
    def kind(length):
        return "a number" if length is None else f"a list of {length}"

    first = {}  # depth -> (path, length of the first entry there, None for a number)
    stack = [(data, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, list):
            length = len(value)
            stack.extend((v, f"{path}[{i}]", depth + 1) for i, v in reversed(list(enumerate(value))))
        elif isinstance(value, (int, float)):  # true/false too: torch takes them as 1/0
            length = None
        else:
            return f"data{path} is {_show(value)}; {datatype} data holds numbers only, flattened or in nested lists"
        seen_path, seen = first.setdefault(depth, (path, length))
        if seen != length:
            return (f"data{path} is {kind(length)} but data{seen_path} is {kind(seen)}; send the values flattened, "
                    "or in nested lists of equal lengths")
    return f"a value is out of the range of {datatype}; send values that {datatype} holds"


class _Infer:
    """Decoding a KServe request into one tensor, encoding one tensor into its answer."""

    @staticmethod
    def parse(raw: bytes, header_length: str | None) -> tuple[dict, bytes]:
        if header_length is not None:
            try:
                n = int(header_length)
            except ValueError:
                fail(400, f"Inference-Header-Content-Length must be an integer, got {header_length[:20]!r}")
            if not 0 < n <= len(raw):
                fail(400, f"Inference-Header-Content-Length {n} does not fit a body of {len(raw)} bytes")
            head, binary = raw[:n], raw[n:]
        else:
            head, binary = raw, b""
        try:
            body = json.loads(head)
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            fail(400, f"body: not valid JSON ({str(exc)[:200]}); send an inference request object")
        if not isinstance(body, dict):
            fail(400, "body: must be a JSON object with 'inputs'")
        return body, binary

    @staticmethod
    def input_specs(body: dict) -> list[dict]:
        """The request's input tensor objects, 1 to MAX_MEMBERS of them."""
        from blockflow.tensormq.bundle import MAX_MEMBERS  # with torch: see the module's docstring
        inputs = body.get("inputs")
        if not isinstance(inputs, list) or not 1 <= len(inputs) <= MAX_MEMBERS or not all(
                isinstance(i, dict) for i in inputs):
            fail(400, f"inputs: send 1 to {MAX_MEMBERS} input tensor objects in 'inputs'")
        return inputs

    @staticmethod
    def inputs(inputs: list[dict], binary: bytes, task: str, expected: list[str] | None):
        """The request's value: one tensor for one input, else a tuple in the order of
        ``expected``, the input names the request must carry (each once, in any order; see
        ``V2.input_names``); binary inputs take their bytes from the binary section one after
        another. ``expected`` is None for a task not served now: the dispatcher answers that."""
        names = [spec.get("name") for spec in inputs]
        if expected is not None and sorted(map(str, names)) != sorted(expected):
            fail(400, f"inputs: task {task} takes {_name_list(expected)}, got {_name_list(names)}; name the inputs "
                      f"as GET /v2/models/{task} lists them")
        tensors, offset = [], 0
        for i, spec in enumerate(inputs):
            t, offset = _Infer.tensor(spec, binary, offset, f"inputs[{i}]")
            tensors.append(t)
        if offset != len(binary):
            fail(400, f"the binary section has {len(binary)} bytes but the inputs' binary_data_size add up to {offset}")
        if len(tensors) == 1:
            return tensors[0]
        if expected is not None:
            tensors = [tensors[names.index(n)] for n in expected]
        return tuple(tensors)

    @staticmethod
    def tensor(spec: dict, binary: bytes, offset: int, where: str) -> tuple[torch.Tensor, int]:
        """One input tensor and where the next binary input starts."""
        import torch
        datatype = spec.get("datatype")
        if datatype not in DATATYPES:
            fail(400, f"{where}.datatype: {str(datatype)[:20]!r} is not one of {', '.join(DATATYPES)}")
        shape = spec.get("shape")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                  for d in shape):
            fail(400, f"{where}.shape: must be a list of non-negative integers")
        dtype = getattr(torch, DATATYPES[datatype])
        count = math.prod(shape)
        size = count * torch.empty((), dtype=dtype).element_size()
        if size > MAX_TENSOR_BYTES:
            fail(413, f"{where}: {size} bytes is larger than the {MAX_TENSOR_BYTES} a tensor may have")
        params = spec.get("parameters") or {}
        if "binary_data_size" in params:
            raw = binary[offset:offset + size]
            if params["binary_data_size"] != size or len(raw) != size:
                fail(400, f"{where}.parameters.binary_data_size: shape {shape} of {datatype} is {size} bytes; "
                          f"the request carries {len(raw)} for it")
            if dtype == torch.bfloat16:
                t = torch.frombuffer(bytearray(raw), dtype=torch.int16).view(torch.bfloat16).reshape(shape)
            else:
                t = torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape) if size else torch.empty(shape, dtype=dtype)
            return t, offset + size
        data = spec.get("data")
        if not isinstance(data, list):
            fail(400, f"{where}.data: missing; send the values (flattened or nested) or use the binary-data extension")
        try:
            t = torch.tensor(data, dtype=dtype)
        except (TypeError, ValueError, RuntimeError, OverflowError):
            fail(400, f"{where}.{why_not_values(data, datatype)}")
        if t.numel() != count:
            fail(400, f"{where}.data: {t.numel()} values, but shape {shape} needs {count}")
        return t.reshape(shape), offset

    @staticmethod
    def binary_output(body: dict, name: str) -> bool:
        outputs = body.get("outputs")
        if isinstance(outputs, list) and outputs:
            asked = [o for o in outputs if isinstance(o, dict) and o.get("name") in (name, None)] or outputs[:1]
            params = asked[0].get("parameters") if isinstance(asked[0], dict) else None
            return bool((params or {}).get("binary_data", False))
        return bool((body.get("parameters") or {}).get("binary_data_output", False))

    @staticmethod
    def answer(task: str, body: dict, y) -> bytes:
        """The reply: one output ``output`` for a tensor, ``output_0``, ``output_1``, ... for a
        tuple, the dict's keys for a dict; each in JSON or binary, as the request asks."""
        import torch
        from blockflow.tensormq import bundle
        if isinstance(y, torch.Tensor):
            named = [("output", y)]
        else:
            members, keys = bundle.flatten(y, f"task {task}'s result")
            named = list(zip(keys or [f"output_{i}" for i in range(len(members))], members))
        outs, raws = [], []
        for name, t in named:
            datatype = TORCH_TO_DATATYPE.get(str(t.dtype).removeprefix("torch."))
            if datatype is None:
                fail(502, f"task {task} produced a {t.dtype} tensor ({name}), which the Open Inference Protocol "
                          "cannot carry")
            t = t.detach().cpu().contiguous()
            out = {"name": name, "datatype": datatype, "shape": list(t.shape)}
            if _Infer.binary_output(body, name):
                raw = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()
                out["parameters"] = {"binary_data_size": len(raw)}
                raws.append(raw)
            else:
                out["data"] = (t.float() if t.dtype == torch.bfloat16 else t).flatten().tolist()
            outs.append(out)
        reply = {"model_name": task, "model_version": "1", "outputs": outs}
        if isinstance(body.get("id"), str):
            reply["id"] = body["id"]
        head = json.dumps(reply).encode()
        if raws:
            cherrypy.response.headers["Content-Type"] = "application/octet-stream"
            cherrypy.response.headers["Inference-Header-Content-Length"] = str(len(head))
            return head + b"".join(raws)
        cherrypy.response.headers["Content-Type"] = "application/json"
        return head


@cherrypy.expose
class V2:
    """/v2/...: routed by hand (see the module docstring for the paths)."""

    def __init__(self, manager):
        self.manager = manager
        self._client = None
        self._client_lock = threading.Lock()
        #: (update version, {task: input names its manifest declares, or None}): _declared_inputs
        self._input_names: tuple[int, dict[str, list[str] | None]] = (-1, {})
        cherrypy.engine.subscribe("stop", self.close)

    # -- routing -----------------------------------------------------------------------------
    def _cp_dispatch(self, vpath):
        cherrypy.request.blockflow_v2 = list(vpath)
        del vpath[:]
        return self

    def _route(self) -> tuple[str, str | None]:
        """(what, task) for the path after /v2."""
        parts = getattr(cherrypy.request, "blockflow_v2", [])
        if not parts:
            return "server", None
        if parts in (["health", "live"], ["health", "ready"]):
            return "health_" + parts[1], None
        if len(parts) >= 2 and parts[0] == "models":
            task, rest = parts[1], parts[2:]
            if rest[:1] == ["versions"]:
                if len(rest) < 2 or rest[1] != "1":
                    fail(404, f"task {task} has one version, '1'")
                rest = rest[2:]
            if rest in ([], ["ready"], ["infer"]):
                return (rest[0] if rest else "model"), task
        fail(404, f"no /v2/{'/'.join(parts)[:100]}; see GET /v2 and /v2/models/{{task}}")

    # -- GET ---------------------------------------------------------------------------------
    @cherrypy.tools.json_out()
    def GET(self, **params):
        what, task = self._route()
        if what == "server":
            from blockflow import __version__
            return {"name": "blockflow", "version": __version__, "extensions": ["binary_tensor_data"]}
        if what == "health_live":
            return {"live": True}
        if what == "health_ready":
            if not self.manager.ready():
                fail(503, "not ready: the dispatcher or a block is not running; GET /system says which")
            return {"ready": True}
        if what == "infer":
            fail(405, f"infer takes POST: POST /v2/models/{task}/infer")
        system = self.manager.snapshot()
        path = next((t["path"] for t in system["tasks"] if t["id"] == task), None)
        if path is None:
            served = ", ".join(sorted(t["id"] for t in system["tasks"])) or "none"
            fail(404, f"no task {task!r}; tasks served now: {served}")
        if what == "model":
            return self._metadata(task, path, system)
        blocks = {b["name"]: b for b in system["blocks"]}
        down = [n for n in path if blocks.get(n, {}).get("status") != "ready"]
        if down:
            fail(503, f"task {task} is not ready: block(s) {', '.join(down)} not running")
        return {"name": task, "ready": True}

    def _metadata(self, task: str, path: list[str], system: dict) -> dict:
        first, last = self._end_entries(path, system)
        return {"name": task, "versions": ["1"], "platform": "blockflow",
                "inputs": [{"name": n, "datatype": t, "shape": d}
                           for (n, d), t in zip(declared_tensors(first, "input"), declared_dtypes(first, "input"))],
                "outputs": [{"name": n, "datatype": t, "shape": d}
                            for (n, d), t in zip(declared_tensors(last, "output"), declared_dtypes(last, "output"))],
                "parameters": {"path": list(path)}}

    def _end_entries(self, path: list[str], system: dict) -> tuple[dict | None, dict | None]:
        """The manifest entries of the file a task's path starts with and the one it ends with
        (a fused block runs several files: its first takes the input, its last makes the output)."""
        blocks = {b["name"]: b for b in system["blocks"]}

        def files(block):
            model = blocks.get(block, {}).get("model")
            return model if isinstance(model, list) else [model]

        return self._manifest_entry(files(path[0])[0]), self._manifest_entry(files(path[-1])[-1])

    def input_names(self, task: str, count: int) -> list[str] | None:
        """The names a request with ``count`` inputs to ``task`` must give them: those its first
        block's manifest entry declares (GET /v2/models/{task} lists them); without an entry,
        ``input`` for one and ``input_0``, ``input_1``, ... for several. None for a task not
        served now (the dispatcher answers that request)."""
        declared = self._declared_inputs(task)
        if declared is _NOT_SERVED:
            return None
        if declared is not None:
            return declared
        return ["input"] if count == 1 else [f"input_{i}" for i in range(count)]

    def _declared_inputs(self, task: str):
        """The input names the manifest entry of ``task``'s first file declares, None without
        an entry, _NOT_SERVED for a task not served. Read once per task and update version."""
        version, known = self._input_names
        if version == self.manager.version and task in known:
            return known[task]
        system = self.manager.snapshot()
        path = next((t["path"] for t in system["tasks"] if t["id"] == task), None)
        if path is None:
            return _NOT_SERVED
        entry = self._end_entries(path, system)[0]
        names = [n for n, _ in declared_tensors(entry, "input")] if entry else None
        if version != system["version"]:
            known = {}
            self._input_names = (system["version"], known)
        known[task] = names
        return names

    def _manifest_entry(self, model: str | None) -> dict | None:
        """The manifest entry of a block file, for shapes only (loading checks the sha256)."""
        if not isinstance(model, str) or not model:
            return None
        manifest = os.path.join(str(self.manager.repo), os.path.dirname(model), "manifest.json")
        try:
            with open(manifest) as f:
                entry = json.load(f).get("blocks", {}).get(os.path.basename(model))
        except (OSError, ValueError, AttributeError):
            return None
        return entry if isinstance(entry, dict) else None

    # -- POST infer --------------------------------------------------------------------------
    def POST(self, **params):
        what, task = self._route()
        if what != "infer":
            fail(405, "POST is allowed on /v2/models/{task}/infer only")
        raw = cherrypy.request.body.read(MAX_BODY + 1)
        if len(raw) > MAX_BODY:
            fail(413, f"body is larger than {MAX_BODY} bytes")
        body, binary = _Infer.parse(raw, cherrypy.request.headers.get("Inference-Header-Content-Length"))
        specs = _Infer.input_specs(body)
        x = _Infer.inputs(specs, binary, task, self.input_names(task, len(specs)))
        from blockflow.client import BlockFlowError
        try:
            y = self.client().infer(task, x, traceparent=cherrypy.request.headers.get("traceparent"))
        except BlockFlowError as exc:
            fail(STATUS.get(exc.code, 500), str(exc))
        except TimeoutError as exc:
            fail(504, str(exc))
        return _Infer.answer(task, body, y)

    def client(self):
        """One BlockFlow client for every request of this process, made on first use."""
        with self._client_lock:
            if self._client is None:
                from blockflow.client import Client
                dispatcher = self.manager.snapshot().get("dispatcher") or {}
                endpoint = dispatcher.get("endpoint")
                if not endpoint:
                    fail(503, "the dispatcher is not running; retry when GET /v2/health/ready answers 200")
                token = cherrypy.request.app.config.get("blockflow", {}).get("token")
                self._client = Client(endpoint, token=token or "")
            return self._client

    def close(self) -> None:
        with self._client_lock:
            if self._client is not None:
                self._client.close()
                self._client = None
