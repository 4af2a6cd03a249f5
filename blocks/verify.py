"""Block files checked before anything loads them: inside the repository, and matching the
sha256 their directory's manifest lists (blocks/repository.py explains why both matter).

Nothing here imports torch: the manager checks every file an update names before it starts a
block, and the control plane (``blockflow serve``) never runs a model, so it stays without
torch. blocks/repository.py, which loads the files, re-exports these names.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

MANIFEST = "manifest.json"
_HASH_CHUNK = 1 << 20


class BlockFileError(Exception):
    """A block file (or its manifest) is missing, corrupt or not TorchScript.

    The message always names the file and says what to do about it; ``path``
    holds the offending file when known.
    """

    def __init__(self, message: str, path: str | os.PathLike | None = None):
        super().__init__(message)
        self.path = Path(path) if path is not None else None


def read_manifest(path: Path) -> dict:
    """The manifest at ``path``; a :class:`BlockFileError` naming it when it is unreadable."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BlockFileError(
            f"manifest {path.resolve()} is unreadable ({exc}); delete it and "
            f"re-run `blockflow export --model {path.parent.name}`",
            path,
        ) from None
    if not isinstance(data, dict) or not isinstance(data.get("blocks", {}), dict):
        raise BlockFileError(
            f"manifest {path.resolve()} has an unexpected format; delete it and "
            f"re-run `blockflow export --model {path.parent.name}`",
            path,
        )
    return data


def resolve(repo: str | os.PathLike, relpath: str | os.PathLike) -> Path:
    """``repo/relpath``, refusing absolute paths and ``..`` escapes (block
    paths come from configs/REST requests, so they must stay inside the repo).
    The check is lexical, so a repo may still contain symlinked files:
    :func:`verify_block` decides whether one that leads outside is served."""
    rel = os.fspath(relpath)
    root = Path(repo).resolve()
    if not rel or os.path.isabs(rel) or Path(rel).anchor:
        raise BlockFileError(
            f"block path {rel!r} must be relative to the repository {root}", rel)
    norm = os.path.normpath(rel)
    if norm == ".." or norm.startswith(".." + os.sep) or norm.startswith("../"):
        raise BlockFileError(
            f"block path {rel!r} escapes the repository {root}; use a path "
            "inside it such as 'resnet50/block1.pt'", rel)
    return root / norm


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(_HASH_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def verify_block(repo: str | os.PathLike, relpath: str, hash_file: bool = True) -> dict | None:
    """Check ``repo/relpath`` against the manifest of its directory.

    Returns the manifest entry, or ``None`` for a file no manifest lists
    (user-dropped TorchScript files are allowed and served as is).
    ``hash_file=False``: only find the entry; the caller checks the bytes it reads.
    """
    path = resolve(repo, relpath)
    model = path.parent.name
    if not path.is_file():
        raise BlockFileError(
            f"block file {path} not found: run `blockflow export --model {model}` "
            f"to create it, or fix the path {relpath!r}", path)
    root = Path(repo).resolve()
    real = path.resolve()
    outside = not real.is_relative_to(root)
    manifest_path = path.parent / MANIFEST
    entry = None
    if manifest_path.exists() and manifest_path.resolve().is_relative_to(root):
        entry = read_manifest(manifest_path).get("blocks", {}).get(path.name)
    if outside and not (isinstance(entry, dict) and isinstance(entry.get("sha256"), str)):
        raise BlockFileError(
            f"block file {relpath!r} resolves to {real}, outside the repository {root}; "
            f"such a file is served only when {root / os.path.dirname(os.path.normpath(relpath)) / MANIFEST} "
            f"(inside the repository) lists {path.name!r} with its sha256 -- add it there, "
            "or copy the file into the repository", path)
    if entry is None:
        return None
    if hash_file:
        check_digest(path, sha256_file(real), str(entry.get("sha256", "")))
    return entry


def check_digest(path: Path, actual: str, expected: str) -> None:
    if actual != expected:
        raise BlockFileError(
            f"block file {path} does not match {path.parent / MANIFEST}: sha256 "
            f"{actual[:12]}... but the manifest expects {expected[:12]}...; the file "
            f"is corrupt or was modified -- re-export it with `blockflow export "
            f"--model {path.parent.name}`", path)


def file_signature(st: os.stat_result) -> list[int]:
    """What tells one version of a file from another without reading it: device, inode,
    size and modification time (ns). A file rewritten in place or replaced changes it."""
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]
