"""A minimal OTLP/HTTP traces receiver: what a collector would get from BlockFlow, kept in memory.

Used by tests/process/test_tracing.py and experiments/tracing.py as the real other end of the
OpenTelemetry exporter (blockflow/core/tracing.py): it decodes each POST /v1/traces body with
opentelemetry-proto's own ``ExportTraceServiceRequest`` and keeps one dict per span.
"""
from __future__ import annotations

import gzip
import http.server
import threading

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                      ExportTraceServiceResponse)


def _value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class OtlpReceiver:
    """``with OtlpReceiver() as r:`` listens on 127.0.0.1 (a free port); ``r.endpoint`` is what
    BLOCKFLOW_OTLP_ENDPOINT takes; ``r.spans()`` what arrived so far."""

    def __init__(self):
        self._spans: list[dict] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver._keep(request)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, name="otlp-receiver", daemon=True)

    def _keep(self, request) -> None:
        spans = []
        for rs in request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append({"trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
                                  "parent_span_id": s.parent_span_id.hex() or None, "name": s.name,
                                  "start_ns": s.start_time_unix_nano, "end_ns": s.end_time_unix_nano,
                                  "attributes": {a.key: _value(a.value) for a in s.attributes},
                                  "status": s.status.code, "service": resource.get("service.name"),
                                  "resource": resource})
        with self._lock:
            self._spans.extend(spans)

    def spans(self) -> list[dict]:
        with self._lock:
            return list(self._spans)

    def __enter__(self) -> "OtlpReceiver":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)
