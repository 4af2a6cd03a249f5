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
