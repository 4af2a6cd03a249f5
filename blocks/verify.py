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
#: The torchvision ResNets that ``blockflow export`` splits itself (blocks/repository.py), and the
#: block counts it splits them into (4: block1..block4 + head; 2: block12, block34 + head; 1: the
#: full model only); every other model is cut at named submodules (blocks/split.py). Here, beside
#: the hints that name those exports, so that the command checks them without torch.
RESNETS = ("resnet18", "resnet50", "resnet152")
RESNET_SPLITS = (1, 2, 4)
#: The file suffix of each block format: TorchScript archives or torch.export programs.
SUFFIX = {"torchscript": ".pt", "export": ".pt2"}
#: What an export traces with unless told (``blockflow export --input-shape``), batch first.
DEFAULT_INPUT_SHAPE = [1, 3, 224, 224]


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
            f"manifest {path.resolve()} is unreadable ({exc}); delete it and write it again: "
            f"{_rewrite_manifest(path.parent)}", path) from None
    if not isinstance(data, dict) or not isinstance(data.get("blocks", {}), dict):
        raise BlockFileError(
            f"manifest {path.resolve()} has an unexpected format; delete it and write it again: "
            f"{_rewrite_manifest(path.parent)}", path)
    return data


def _rewrite_manifest(directory: Path) -> str:
    """How a lost manifest is written again (nothing says any more how the files were made)."""
    if directory.name in RESNETS:
        return f"`blockflow export --model {directory.name} --out {directory.parent}`"
    return (f"`blockflow manifest {directory}` for your own files, or the `blockflow export` "
            "that made them")


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
    if not path.is_file():
        raise BlockFileError(f"block file {path} not found: {_missing_hint(repo, relpath, path)}", path)
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
        check_digest(path, sha256_file(real), str(entry.get("sha256", "")), repo)
    return entry


def check_digest(path: Path, actual: str, expected: str, repo: str | os.PathLike | None = None) -> None:
    """A :class:`BlockFileError` when ``actual`` is not the ``expected`` sha256 of ``path``, saying
    how to make the file right again as its manifest says it was made (``repo``: the repository
    as the user named it, for the paths in that hint)."""
    if actual != expected:
        raise BlockFileError(
            f"block file {path} does not match {path.parent / MANIFEST}: sha256 "
            f"{actual[:12]}... but the manifest expects {expected[:12]}...; {changed_hint(path, repo)}", path)


# --------------------------------------------------------------------------
# Hints: what makes a block file right again
# --------------------------------------------------------------------------
#
# The manifest records how each file was made, so an error can give the one command that fixes
# it: a ResNet export lists "model" (resnet18/50/152) and per file its "name", "variant",
# "format" and "method"; a split at named cuts (blocks/split.py) adds "source" (the --model
# given) and "cuts"; `blockflow manifest` (blocks/manifest.py) marks a file it listed fresh with
# "method": "hand-made", and no export command can make that file again.


def changed_hint(path: Path, repo: str | os.PathLike | None = None) -> str:
    """What to do about block file ``path`` that no longer matches its manifest (a phrase)."""
    directory = _shown(path.parent, repo)
    manifest, entry = _listing(path)
    command = export_command(path.parent, manifest, entry, repo) if entry else None
    if command:
        return f"the file is corrupt or was modified -- re-export it with `{command}`"
    return (f"the file was modified or is corrupt -- if the new file is right, list it again with "
            f"`blockflow manifest {directory}`; otherwise put back the file the manifest lists")


def remake_hint(path: Path, repo: str | os.PathLike | None = None) -> str:
    """How to replace block file ``path`` that cannot be loaded (a phrase)."""
    manifest, entry = _listing(path)
    command = export_command(path.parent, manifest, entry, repo) if entry else None
    if command:
        return f"re-export it with `{command}`"
    kind = "a torch.export'ed program (torch.export.save)" if path.suffix == ".pt2" else "a torch.jit.save'd module"
    return f"replace it with {kind}, then run `blockflow manifest {_shown(path.parent, repo)}`"


def export_command(directory: Path, manifest: dict, entry: dict, repo: str | os.PathLike | None = None) -> str | None:
    """The ``blockflow export`` line that writes the file of ``entry`` (listed in ``manifest`` of
    ``directory``) again, or ``None`` when no export made it (a hand-made file, or unknown)."""
    if not isinstance(entry, dict) or entry.get("method") in (None, "hand-made"):
        return None
    fmt = entry.get("format") or ("export" if str(entry.get("file", "")).endswith(".pt2") else "torchscript")
    source, cuts, model = manifest.get("source"), manifest.get("cuts"), manifest.get("model")
    if isinstance(source, str) and isinstance(cuts, list):  # a split at named cuts (blocks/split.py)
        args = ["--model", source, *(a for cut in cuts for a in ("--cut", str(cut)))] if cuts else \
               ["--model", source, "--blocks", "1"]
        default_name = source.rsplit(":", 1)[1].rsplit(".", 1)[-1] if ":" in source else source
        if directory.name != default_name:
            args += ["--name", directory.name]
        full = manifest.get("blocks", {}).get("full.pt2" if fmt == "export" else "full.pt")
        shape = full.get("input_shape") if isinstance(full, dict) else None
        if isinstance(shape, list) and shape != DEFAULT_INPUT_SHAPE:
            args += ["--input-shape", ",".join(str(d) for d in shape)]
    elif model in RESNETS and directory.name == model:  # the ResNet export (blocks/repository.py)
        args = ["--model", model]
        name = str(entry.get("name", ""))
        if name in ("block12", "block34"):
            args += ["--blocks", "2"]
        if entry.get("variant"):
            args += ["--variant", str(entry["variant"]), "--variant-blocks", name]
    else:
        return None
    if isinstance(manifest.get("seed"), int) and manifest["seed"] != 0:
        args += ["--seed", str(manifest["seed"])]
    args += ["--format", fmt]
    if fmt == "torchscript" and entry.get("method") == "trace":
        args += ["--method", "trace"]
    return " ".join(["blockflow export", *args, "--out", _shown(directory.parent, repo)])


def _missing_hint(repo: str | os.PathLike, relpath: str, path: Path) -> str:
    """What to do about a block file an update names that is not there (a phrase): name the file
    of the other format beside it, the command that writes it again, or the files there are."""
    directory = path.parent
    shown_dir = _shown(directory, repo)
    rel_dir = os.path.dirname(os.path.normpath(relpath))
    others = [directory / (path.stem + s) for s in SUFFIX.values() if s != path.suffix]
    for other in others:
        if other.is_file():
            kind = "a torch.export program" if other.suffix == ".pt2" else "TorchScript"
            return (f"{shown_dir} has {other.name} ({kind}) instead: name "
                    f"`{os.path.join(rel_dir, other.name)}` in the update, or fix the path {relpath!r}")
    manifest, entry = _listing(path)
    if entry:
        command = export_command(directory, manifest, entry, repo)
        if command:
            return f"{MANIFEST} lists it: write it again with `{command}`, or fix the path {relpath!r}"
        return (f"{MANIFEST} lists it, as a file of your own: put it back (then `blockflow manifest "
                f"{shown_dir}` if it changed), or fix the path {relpath!r}")
    present = sorted(p.name for p in directory.iterdir() if p.suffix in SUFFIX.values()) if directory.is_dir() else []
    if present:
        more = f" and {len(present) - 6} more" if len(present) > 6 else ""
        return f"fix the path {relpath!r}: {shown_dir} has {', '.join(present[:6])}{more}"
    out = _shown(directory.parent, repo)
    if directory.name in RESNETS:
        return f"run `blockflow export --model {directory.name} --out {out}` to create it, or fix the path {relpath!r}"
    return (f"fix the path {relpath!r}, or make the files: `blockflow export --model NAME_OR_CALLABLE --cut LAYER "
            f"--name {directory.name} --out {out}`, or copy your own there and run `blockflow manifest {shown_dir}`")


def _listing(path: Path) -> tuple[dict, dict | None]:
    """The manifest of ``path``'s directory and its entry for ``path`` (``{}``/``None`` when there
    is none or it cannot be read: a hint never fails)."""
    try:
        manifest = read_manifest(path.parent / MANIFEST) if (path.parent / MANIFEST).is_file() else {}
    except BlockFileError:
        manifest = {}
    entry = manifest.get("blocks", {}).get(path.name)
    return manifest, entry if isinstance(entry, dict) else None


def _shown(path: Path, repo: str | os.PathLike | None) -> str:
    """``path`` as the user names it: under the repository as given (``model_repo/mine``) when
    known, else absolute."""
    if repo is not None:
        root = Path(repo).resolve()
        if path == root:
            return os.fspath(repo)
        if path.is_relative_to(root):
            return os.path.join(os.fspath(repo), path.relative_to(root).as_posix())
    return str(path)


def file_signature(st: os.stat_result) -> list[int]:
    """What tells one version of a file from another without reading it: device, inode,
    size and modification time (ns). A file rewritten in place or replaced changes it."""
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]
