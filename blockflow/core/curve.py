"""CURVE keys of a cluster: how bytes between nodes are kept to the deployment's own processes.

In Ray mode (``blockflow serve --ray``, issue 30) the manager makes one ``ClusterKeys`` at start:
a server pair, which every CURVE server of the deployment uses (a block's TCP data socket, the
dispatcher's TCP result socket, the controller's TCP endpoint), and one client pair, which every
process that connects to them uses. The keys travel inside the specs the manager hands to Ray
(the control plane), never through files on one disk. A server admits a connection only when a
ZAP handler (``authenticator``) finds the deployment's client public key in it: a peer without
the client secret cannot complete the handshake, so nothing it sends is ever read.

Who owns what: the manager creates the keys and lives with them; each child gets a copy in its
spec and keeps it for its life; nothing is written to disk by this module.
"""
from __future__ import annotations

import hmac
import logging
from dataclasses import dataclass

import zmq
from zmq.auth.thread import ThreadAuthenticator


@dataclass(frozen=True)
class ClusterKeys:
    server_public: str
    server_secret: str
    client_public: str
    client_secret: str

    @classmethod
    def generate(cls) -> "ClusterKeys":
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return cls(server_public.decode(), server_secret.decode(), client_public.decode(), client_secret.decode())

    def to_json(self) -> dict:
        return {"server_public": self.server_public, "server_secret": self.server_secret,
                "client_public": self.client_public, "client_secret": self.client_secret}

    @classmethod
    def from_json(cls, d: dict | None) -> "ClusterKeys | None":
        return None if d is None else cls(**{k: d[k] for k in ("server_public", "server_secret", "client_public",
                                                                "client_secret")})


class OnlyKey:
    """ZAP credentials provider: admits the one CURVE client public key it was given."""

    def __init__(self, public: bytes):
        self.public = public

    def callback(self, domain: str, key: bytes) -> bool:
        return hmac.compare_digest(key, self.public)


def authenticator(ctx: zmq.Context, client_public: bytes, name: str) -> ThreadAuthenticator:
    """Start the ZAP handler of ``ctx``: CURVE servers of this context admit ``client_public`` only.
    Sockets without CURVE (ipc://, inproc://) are not asked about (no ZAP domain is set on them)."""
    auth = ThreadAuthenticator(ctx, log=logging.getLogger(f"blockflow.{name}.zap"))
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=OnlyKey(client_public))
    return auth


def make_server(sock: zmq.Socket, secret: bytes) -> None:
    """CURVE server options; they apply to the binds made after this call only (libzmq copies a
    socket's options into each listener when it binds), so a socket may keep an ipc:// endpoint
    bound earlier without CURVE and add a TCP one with it."""
    sock.curve_server = True
    sock.curve_secretkey = secret


def make_client(sock: zmq.Socket, server_public: bytes, public: bytes, secret: bytes) -> None:
    """CURVE client options; they apply to the connects made after this call."""
    sock.curve_serverkey = server_public
    sock.curve_publickey = public
    sock.curve_secretkey = secret


def client_of(sock: zmq.Socket, keys: ClusterKeys) -> None:
    """Make ``sock`` a client of the cluster's CURVE servers (before it connects)."""
    make_client(sock, keys.server_public.encode(), keys.client_public.encode(), keys.client_secret.encode())
