"""Outputs made in a slot: a block's model allocates its output in a TensorMQ slot, not on the heap.

Note [Outputs made in a slot]
-----------------------------
Without this, a block whose model makes a new tensor (anything but a view of its input) sends
it by copying it into a slot of the next edge (``SlotPool.put``): at 3.2 MB that copy was half
of TensorMQ's hop on the 2-core VM, about what the model's own ``x + 1`` costs. PyTorch has no
Python hook to say where a CPU tensor is allocated, so a small C++ extension
(``outalloc.cpp``) wraps PyTorch's CPU allocator:

- Before the model runs, the inference thread *lends* free slots of the next edge
  (``SlotPool.lend``) and *arms* them for the output's size, which the block learnt from the
  previous request with the same input shape (the first request of a shape copies as before).
- While armed, an allocation *by that thread* of exactly that size is given the first lent
  region no storage holds; every other allocation (other sizes, other threads) goes to
  PyTorch's allocator as before. An intermediate of that size may take a region and free it
  again: the region is lendable again as soon as no storage holds it.
- After the model, the slot the output was made in (``SlotPool.holder``) is *adopted*
  (``SlotPool.adopt``): it goes in flight with a handle, exactly as after a copy, and nothing
  was copied. Otherwise the output is copied into a slot as before.
- How many slots to lend is learnt once per block, from one: when the output was made
  elsewhere although tensors of its size took every lent region (``disarm()`` counts the
  takes), the next request lends one more, up to ``MAX_LENT`` (blocks/process.py). ``x + 1``
  needs one; a ResNet stage needs two or three (the identity branch, the last convolution's
  output and its batch norm's are alive together), learnt over its first few requests. The
  count is the model's, not the shape's: a new batch size copies its first output only.

Ownership (Note [TensorMQ slot ownership] in shm.py still holds): the slot's memory belongs to
the producer's mapping, never to the allocator; the extension's deleter only records that no
storage holds the region. So a slot is reused only when it is FREE *and* no storage holds it:
a slot that some tensor still holds after it came back (a model that keeps its output or an
intermediate in its state) is retired from its edge rather than written under that tensor,
and its mapping is kept until the process ends (unmapping it would leave that tensor pointing
at nothing).

Build: ``blockflow build-ext`` compiles the extension with PyTorch's
own tooling (``torch.utils.cpp_extension``: a C++ compiler and ninja, about 25 s) into
``BLOCKFLOW_EXT_DIR``, keyed by the PyTorch version, the Python ABI and the source's hash;
``make install`` runs it. A block never compiles: without a built extension (or with
``BLOCKFLOW_OUTPUT_IN_SLOT=0``) it logs why once and copies outputs as before. The built
library is loaded only from a directory and a file of this user that nobody else can write.
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import stat
import sys
import threading

from blockflow.core import settings

log = logging.getLogger(__name__)

NAME = "blockflow_outalloc"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "outalloc.cpp")

_loaded = None  # the extension module once load() succeeded in this process
_why_not: str | None = None  # why load() returned None
#: load() runs once per process: the blocks of a shared process (blocks/host.py) start on their
#: own threads, and two of them executing the extension's module at once was seen to leave one
#: with a module that had no ``install`` yet (a member then failed to start)
_load_lock = threading.Lock()


def build_dir(root: str | None = None) -> str:
    """Where the extension for this PyTorch, this Python and this source is built."""
    import torch
    with open(SOURCE, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    tag = f"torch{torch.__version__}-{sys.implementation.cache_tag}-{digest}".replace("+", "_")
    return os.path.join(root or settings.EXT_DIR, tag)


def _library(directory: str) -> str | None:
    for name in sorted(os.listdir(directory)):
        if name.startswith(NAME) and name.endswith(".so"):
            return os.path.join(directory, name)
    return None


def _safe(path: str) -> str | None:
    """Why ``path`` must not be loaded (None: it may): it must be this user's and nobody else's to write."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symbolic link"
    if st.st_uid != os.getuid():
        return f"{path} belongs to uid {st.st_uid}, not to this user"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} can be written by other users"
    return None


def build(root: str | None = None, verbose: bool = False):
    """Compile the extension (if this source is not built yet) and return the module."""
    import torch  # noqa: F401  (the extension links against the PyTorch that is imported)
    from torch.utils.cpp_extension import load as load_extension
    directory = build_dir(root)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    os.chmod(directory, 0o700)
    module = load_extension(NAME, sources=[SOURCE], build_directory=directory, extra_cflags=["-O2"],
                            with_cuda=False, verbose=verbose)
    # builds of older sources for this PyTorch and Python are never loaded again
    parent, mine = os.path.split(directory)
    stem = mine.rsplit("-", 1)[0] + "-"
    for name in os.listdir(parent):
        if name.startswith(stem) and name != mine:
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
    return module


def built() -> str | None:
    """The library a block would load (None: none is built for this PyTorch, or it is refused),
    found without loading it: loading installs the allocator in this process."""
    global _why_not
    directory, path = build_dir(), None
    if not os.path.isdir(directory):
        problem = f"it is not built for this PyTorch in {settings.EXT_DIR}; run `blockflow build-ext`"
    else:
        problem = _safe(directory)
        if problem is None:
            path = _library(directory)
            problem = _safe(path) if path else f"{directory} holds no {NAME} library; run `blockflow build-ext`"
    _why_not = problem
    return None if problem else path


def load():
    """The built extension, installed as this process's CPU allocator; None when it is not
    built or is refused (``why_not()`` says which). Thread-safe: one thread loads it."""
    if _loaded is not None:
        return _loaded
    with _load_lock:
        return _load_once()


def _load_once():
    global _loaded, _why_not
    if _loaded is not None:
        return _loaded
    if not settings.OUTPUT_IN_SLOT:
        _why_not = "BLOCKFLOW_OUTPUT_IN_SLOT=0"
        return None
    try:
        path = built()
    except OSError as exc:
        _why_not = f"cannot read {SOURCE}: {exc.strerror}"
        return None
    if path is None:
        return None
    import torch  # noqa: F401  (its libraries resolve the extension's symbols)
    spec = importlib.util.spec_from_file_location(NAME, path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        module.install()
    except (ImportError, OSError, RuntimeError) as exc:
        _why_not = f"{path} could not be loaded ({exc}); rebuild it with `blockflow build-ext`"
        return None
    _loaded = module
    return module


def active():
    """The extension if this process installed it (slots were lent), else None."""
    return _loaded


def holding() -> bool:
    """Whether any storage holds a lent slot now (the usual answer between two requests is no:
    then no slot needs asking)."""
    return _loaded is not None and _loaded.held_count() > 0


def why_not() -> str | None:
    return _why_not
