"""The model files an update names, checked once per change of each file.

An update is checked at the edge (the REST handler's thread) against the schema
(blockflow/core/schema.py) and then against the repository here: every ``model`` must exist and,
when a manifest lists it, match its sha256. The result is remembered per file together with
the file's signature (device, inode, size, mtime): a later update, or a respawn, naming the same
unchanged file costs a ``stat``, not a hash. The block process receives the verified digest and
signature in its spec and hashes the bytes it loads only when the file changed since
(blocks/repository.py ``open_block``).
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass

from blockflow.blocks.verify import BlockFileError, file_signature, verify_block
from blockflow.core.schema import Update, UpdateError


@dataclass(frozen=True)
class ModelFile:
    path: str                 # relative to the repository, as the update names it
    entry: dict | None        # manifest entry (None: a file no manifest lists)
    signature: tuple          # file_signature() of the version that was checked

    def verified(self) -> dict | None:
        """What a block needs to skip hashing this same version again."""
        if self.entry is None:
            return None
        return {"sha256": self.entry.get("sha256"), "signature": list(self.signature)}


class ModelCatalog:
    def __init__(self, repo: str):
        self.repo = repo
        self._files: dict[str, ModelFile] = {}
        self._lock = threading.Lock()  # REST threads check updates concurrently
        self.hashes = 0                # files hashed since start (tests count them)

    def check(self, relpath: str) -> ModelFile:
        """The checked file ``relpath``; BlockFileError when it is missing or does not match."""
        before = self._signature(relpath)
        with self._lock:
            known = self._files.get(relpath)
        if known is not None and before is not None and known.signature == before:
            return known
        entry = verify_block(self.repo, relpath)  # raises for a missing, escaping or corrupt file
        after = self._signature(relpath)
        checked = ModelFile(relpath, entry, after)
        with self._lock:
            if entry is not None:
                self.hashes += 1
            if after is not None and after == before:  # not rewritten while we hashed it
                self._files[relpath] = checked
        return checked

    def check_update(self, upd: Update) -> None:
        """Check every model of a valid update; fill ``upd.manifests``; UpdateError names the field."""
        for i, decl in enumerate(upd.blocks.values()):
            for j, relpath in enumerate(decl.files):
                try:
                    upd.manifests[relpath] = self.check(relpath).entry
                except BlockFileError as exc:
                    where = f"blocks[{i}].model" + (f"[{j}]" if isinstance(decl.model, tuple) else "")
                    raise UpdateError(where, str(exc)) from None
        check_hand_overs(upd)
        self.check_budgets(upd)

    def check_budgets(self, upd: Update) -> None:
        """Refuse a shared process whose ``memory_budget_mb`` cannot hold its pinned blocks and,
        beside them, its largest other block (the room a swap-in needs: blocks/cache.py), naming
        the blocks and their sizes. A block's size is its manifest's ``param_bytes`` (its
        weights), else its files' size."""
        groups: dict[str, list] = {}
        for i, decl in enumerate(upd.blocks.values()):
            if decl.memory_budget_mb is not None:
                groups.setdefault(decl.process, []).append((i, decl))
        for process, members in groups.items():
            budget = members[0][1].memory_budget_mb
            sizes = {decl.name: self.weight_bytes(upd, decl) for _i, decl in members}
            pinned = [d.name for _i, d in members if d.pinned]
            others = [d.name for _i, d in members if not d.pinned]
            largest = max(others, key=sizes.get) if others else None
            need = sum(sizes[n] for n in pinned) + (sizes[largest] if largest else 0)
            if need > budget * 2**20:
                def mb(n):
                    return f"{n} ({sizes[n] / 2**20:.1f} MB)"
                parts = ([f"pinned {', '.join(mb(n) for n in pinned)}"] if pinned else []) + \
                        ([f"the largest other block {mb(largest)}"] if largest else [])
                i = members[0][0]
                raise UpdateError(f"blocks[{i}].memory_budget_mb",
                                  f"shared process {process!r} needs {need / 2**20:.1f} MB at least ({' and '.join(parts)})"
                                  f", more than its memory_budget_mb {budget:g}; raise the budget"
                                  + (" or pin fewer blocks" if pinned else ""))

    def weight_bytes(self, upd: Update, decl) -> int:
        total = 0
        for relpath in decl.files:
            entry = upd.manifests.get(relpath) or {}
            if isinstance(entry.get("param_bytes"), int):
                total += entry["param_bytes"]
            else:
                try:
                    total += os.path.getsize(os.path.join(self.repo, relpath))
                except OSError:
                    pass
        return total

    def verified(self, files) -> dict[str, dict]:
        """``{file: {"sha256", "signature"}}`` for the block spec; files that cannot be checked
        now are left out (the block then reports why it cannot load them)."""
        out = {}
        for relpath in files:
            try:
                v = self.check(relpath).verified()
            except (BlockFileError, OSError, ValueError):
                continue
            if v is not None:
                out[relpath] = v
        return out

    def _signature(self, relpath: str) -> tuple | None:
        try:
            return tuple(file_signature(os.stat(os.path.join(self.repo, relpath))))
        except (OSError, ValueError):
            return None


# Note [Hand-overs checked at the update]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A task whose path hands one block's output to a block that cannot take it (resnet18's block1,
# 64 channels, then block3, which takes 128) used to be deployed, and then every request failed
# inside the second model with a TorchScript traceback. Where both manifests declare the tensors
# (``output_shape(s)`` of the producer's last file, ``input_shape(s)`` of the consumer's first),
# the update is refused instead, naming the task, both blocks and both shapes. What is certain
# from a manifest is checked, nothing more: the number of tensors, each one's rank and its second
# dimension (channels, features) where both fix it. The batch dimension, a dimension declared
# dynamic (``input_dims``/``output_dims`` name it) and the dimensions after the second (a
# convolutional block takes feature maps of any height and width) are left to the model.

def _members(entry: dict, side: str) -> tuple[list, list] | None:
    """The declared shapes of ``side`` ("input"/"output") with their dims (None: not named), or
    None when the manifest declares none."""
    shapes = entry.get(f"{side}_shapes") or ([entry[f"{side}_shape"]] if entry.get(f"{side}_shape") else None)
    if not shapes or not all(isinstance(s, list) for s in shapes):
        return None
    dims = entry.get(f"{side}_dims") or [None] * len(shapes)
    return shapes, (dims if len(dims) == len(shapes) else [None] * len(shapes))


def _shown(shape: list, dims) -> str:
    named = dims if isinstance(dims, list) and len(dims) == len(shape) else [None] * len(shape)
    return "[" + ", ".join(["N"] + [str(n) if isinstance(n, str) else str(d) for d, n in zip(shape[1:], named[1:])]) + "]"


def _dynamic(dims, i: int) -> bool:
    return isinstance(dims, list) and i < len(dims) and isinstance(dims[i], str)


def hand_over_mismatch(out_entry: dict | None, in_entry: dict | None) -> tuple[str, str] | None:
    """What a model of manifest entry ``out_entry`` hands on and what the model of ``in_entry``
    takes instead, when the second cannot take it (Note [Hand-overs checked at the update]);
    None when it can, or when either entry does not say."""
    made = _members(out_entry or {}, "output")
    taken = _members(in_entry or {}, "input")
    if made is None or taken is None:
        return None
    (outs, out_dims), (ins, in_dims) = made, taken
    if len(outs) != len(ins):
        return (f"{len(outs)} tensor" + ("s" * (len(outs) != 1)), f"{len(ins)} tensor" + ("s" * (len(ins) != 1)))
    for i, (o, n, od, nd) in enumerate(zip(outs, ins, out_dims, in_dims)):
        member = f" as tensor {i}" if len(outs) > 1 else ""
        second_fixed = len(o) > 1 and len(n) > 1 and not _dynamic(od, 1) and not _dynamic(nd, 1)
        if len(o) != len(n) or (second_fixed and o[1] != n[1]):
            return _shown(o, od) + member, _shown(n, nd)
    return None


def check_hand_overs(upd: Update) -> None:
    """Refuse a task whose path hands a block's output to a block that cannot take it, where the
    manifests say so (Note [Hand-overs checked at the update]); inside a fused block, its files'
    hand-overs too."""
    for k, (tid, path) in enumerate(upd.tasks.items()):
        decls = [upd.blocks[name] for name in path]
        for j, decl in enumerate(decls):
            files = decl.files
            steps = [(files[i], files[i + 1], f"block {decl.name!r}, file {i + 1} -> file {i + 2}")
                     for i in range(len(files) - 1)]
            if j + 1 < len(decls):
                nxt = decls[j + 1]
                steps.append((files[-1], nxt.files[0], f"block {decl.name!r} -> block {nxt.name!r}"))
            for made_by, taken_by, hop in steps:
                mismatch = hand_over_mismatch(upd.manifests.get(made_by), upd.manifests.get(taken_by))
                if mismatch:
                    raise UpdateError(f"tasks[{k}].path", f"task {tid!r}, {hop}: {made_by} hands on {mismatch[0]} "
                                      f"but {taken_by} takes {mismatch[1]} (their manifests); fix the path, or "
                                      "export the blocks from one split of the model")
