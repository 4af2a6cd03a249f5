"""The reconciler: what it takes to go from what runs to what an update asks for. Pure.

``plan(current, desired)`` compares block declarations by name and says, for each, whether
the manager spawns it (new name), keeps it (same declaration, still usable), replaces it
(declaration changed, or the running one has failed) or drains it (no longer declared). It
spawns, waits and signals nothing, so it is tested without a single process; the supervisor
(manager.py) carries the plan out step by step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from blockflow.core.schema import BlockDecl


@dataclass(frozen=True)
class Running:
    """What the reconciler needs to know about a block that runs now."""

    decl: BlockDecl
    failed: bool = False


@dataclass(frozen=True)
class Plan:
    spawn: tuple[str, ...] = ()      # new names: start them
    keep: tuple[str, ...] = ()       # same declaration: leave them alone
    replace: tuple[str, ...] = ()    # same name, new declaration (or failed): start anew, drain the old
    drain: tuple[str, ...] = ()      # no longer declared: let their requests finish, then stop them

    @property
    def starts(self) -> tuple[str, ...]:
        """Blocks that must report READY before the switch, in declaration order."""
        return self.spawn + self.replace

    @property
    def retires(self) -> tuple[str, ...]:
        """Running blocks that leave after the switch."""
        return self.drain + self.replace

    def as_diff(self) -> dict:
        return {"spawned": list(self.spawn), "replaced": list(self.replace), "kept": list(self.keep),
                "removed": list(self.drain)}


@dataclass(frozen=True)
class TaskDiff:
    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    changed: tuple[str, ...] = ()

    def as_dict(self) -> dict:
        return {"added": list(self.added), "removed": list(self.removed), "changed": list(self.changed)}


def plan(current: Mapping[str, Running], desired: Mapping[str, BlockDecl]) -> Plan:
    """The steps from ``current`` to ``desired`` (both keyed by block name)."""
    keep = tuple(n for n, d in desired.items() if n in current and current[n].decl == d and not current[n].failed)
    replace = tuple(n for n in desired if n in current and n not in keep)
    spawn = tuple(n for n in desired if n not in current)
    drain = tuple(n for n in current if n not in desired)
    return Plan(spawn=spawn, keep=keep, replace=replace, drain=drain)


def diff_tasks(old: Mapping[str, list[str]], new: Mapping[str, list[str]]) -> TaskDiff:
    return TaskDiff(added=tuple(sorted(set(new) - set(old))), removed=tuple(sorted(set(old) - set(new))),
                    changed=tuple(sorted(t for t in new if t in old and list(old[t]) != list(new[t]))))


@dataclass
class Desired:
    """A whole target state: blocks by name and task paths (what every operation reduces to)."""

    blocks: dict[str, BlockDecl] = field(default_factory=dict)
    tasks: dict[str, list[str]] = field(default_factory=dict)


def without_block(blocks: Mapping[str, BlockDecl], tasks: Mapping[str, list[str]], name: str) -> Desired:
    """The state after deleting block ``name``; ValueError naming the tasks that still use it."""
    users = [t for t, p in tasks.items() if name in p]
    if users:
        raise ValueError(f"block {name} is on the path of task(s) {', '.join(users)}; "
                         "post an update that removes those tasks first")
    return Desired({n: d for n, d in blocks.items() if n != name}, dict(tasks))
