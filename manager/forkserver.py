"""The blocks' forkserver, startable before this process imports torch (kept free of torch itself).

``blockflow serve`` starts it first thing, so that the forkserver's import of torch (its preload)
and the server's own import of torch run at the same time on two cores: a server is ready about
as long sooner as one torch import takes (~2 s). ``Manager.start`` then finds it running.
"""
from __future__ import annotations

import multiprocessing

#: what every block and the dispatcher need, imported once in the forkserver before any fork
PRELOAD = ["blockflow.blocks.process", "blockflow.blocks.host", "blockflow.dispatcher.process"]


def context():
    """The forkserver context the manager spawns its children with, its preload set."""
    mp = multiprocessing.get_context("forkserver")
    mp.set_forkserver_preload(PRELOAD)
    return mp


def start_early() -> None:
    """Start the forkserver now (it imports PRELOAD in the background); returns at once. It exits
    by itself when this process does, so a server that fails to start leaves nothing behind."""
    from multiprocessing import forkserver
    context()
    forkserver.ensure_running()
