"""Three edge-camera tasks on one MobileNetV3-Small backbone: the models behind
``configs/mobilenet_shared.json`` and README "Bring your own model" (one backbone, three heads).

Each task is the same backbone (torchvision's ``mobilenet_v3_small`` features and pooling)
followed by its own classification head, whose weights come from a per-task state dict file::

    scenes    street, highway, parking, intersection, tunnel, bridge, plaza, residential
    vehicles  car, truck, bus, van, motorcycle, bicycle
    weather   clear, rain, fog, snow

``blockflow export --model configs.mobilenet_tasks:scenes --cut features.6 --cut features``
(run from the repository root, which the export puts on ``sys.path``) splits a task's model
into block1 (features 0-6), block2 (features 7-12) and block3 (pooling and the head).  The
export seeds torch's generator (``--seed``, default 0) before it calls the callable, and the
backbone is built before the head, so the three exports' block1 and block2 are the same
weights and the same bytes (same sha256 in their manifests): one process per shared block
serves all three tasks, and only block3 differs.  Nothing is trained: the weights are seeded
stand-ins for a real backbone checkpoint and real fine-tuned heads.

The head state dicts are files ``<task>.pt`` in the directory named by ``MOBILENET_TASKS_HEADS``
(default ``model_repo/heads``, relative to the current directory).  Make them with::

    python -m configs.mobilenet_tasks make-heads [DIR]

A callable whose file is missing fails naming the file and that command.
"""
import argparse
import os
import sys
import zlib
from pathlib import Path

import torch
from torch import nn

#: The tasks and their class labels; a head has one output per label.
TASKS: dict[str, tuple[str, ...]] = {
    "scenes": ("street", "highway", "parking", "intersection", "tunnel", "bridge", "plaza", "residential"),
    "vehicles": ("car", "truck", "bus", "van", "motorcycle", "bicycle"),
    "weather": ("clear", "rain", "fog", "snow"),
}
#: Environment variable naming the directory of the head state dicts, and its default.
HEADS_ENV = "MOBILENET_TASKS_HEADS"
DEFAULT_HEADS_DIR = os.path.join("model_repo", "heads")
#: Width of the backbone's last feature map (mobilenet_v3_small.features[-1]) and of the
#: heads' hidden layer (torchvision's MobileNetV3-Small classifier uses 1024 too).
FEATURES = 576
HIDDEN = 1024


class MissingHeadError(FileNotFoundError, ValueError):
    """A task's head state dict file is missing.  Also a ``ValueError``: ``blockflow export``
    reports a ValueError as one line (the request is wrong, not the code), with no traceback."""


class TaskModel(nn.Module):
    """Backbone then head.  The attribute names are the cut names: ``features.6`` and
    ``features`` are valid single-tensor cuts (MobileNetV3's residuals stay inside a layer),
    and everything after ``features`` is this task's own."""

    def __init__(self, features: nn.Module, avgpool: nn.Module, head: nn.Module):
        super().__init__()
        self.features = features
        self.avgpool = avgpool
        self.head = head

    # No ``from __future__ import annotations`` in this file: torch.fx copies this signature's
    # annotations into the traced code, and TorchScript cannot compile them as strings.
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.avgpool(self.features(x)), 1))


def make_head(classes: int) -> nn.Sequential:
    """A MobileNetV3-Small style classifier head (576 -> 1024 -> classes)."""
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Hardswish(), nn.Dropout(0.2),
                         nn.Linear(HIDDEN, classes))


def heads_dir() -> Path:
    """Where the head state dicts are read: ``$MOBILENET_TASKS_HEADS`` or ``model_repo/heads``."""
    return Path(os.environ.get(HEADS_ENV) or DEFAULT_HEADS_DIR)


def head_seed(task: str) -> int:
    """Each head's own seed (a checksum of its name), so heads differ and are reproducible."""
    return zlib.crc32(task.encode())


def make_heads(directory: str | os.PathLike) -> list[Path]:
    """Write ``<task>.pt`` (a seeded head's state dict) for every task into ``directory``;
    the paths written.  Torch's global generator is left as it was."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for task, labels in TASKS.items():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(head_seed(task))
            head = make_head(len(labels))
        path = out / f"{task}.pt"
        torch.save(head.state_dict(), path)
        paths.append(path)
    return paths


def build(task: str) -> TaskModel:
    """``task``'s model in eval mode: the backbone (weights from torch's generator as it
    stands: ``blockflow export`` seeds it) and the head loaded from its state dict file."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; the tasks are {', '.join(TASKS)}")
    path = heads_dir() / f"{task}.pt"
    if not path.is_file():
        raise MissingHeadError(f"{path}: no head state dict for task {task!r}; make the heads with "
                                f"`python -m configs.mobilenet_tasks make-heads {heads_dir()}` "
                                f"(directory: ${HEADS_ENV}, default {DEFAULT_HEADS_DIR})")
    import torchvision  # here, not at import: `make-heads` needs no torchvision

    # The backbone first: it draws the same numbers from the seeded generator for every
    # task, so the shared blocks are identical; the head's own draws come after and are
    # overwritten by its state dict.
    backbone = torchvision.models.mobilenet_v3_small(weights=None)
    head = make_head(len(TASKS[task]))
    head.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    return TaskModel(backbone.features, backbone.avgpool, head).eval()


def scenes() -> TaskModel:
    """``--model configs.mobilenet_tasks:scenes``"""
    return build("scenes")


def vehicles() -> TaskModel:
    """``--model configs.mobilenet_tasks:vehicles``"""
    return build("vehicles")


def weather() -> TaskModel:
    """``--model configs.mobilenet_tasks:weather``"""
    return build("weather")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m configs.mobilenet_tasks",
                                     description="the example tasks' head state dicts")
    sub = parser.add_subparsers(dest="command", required=True)
    mk = sub.add_parser("make-heads", help="write a seeded head state dict per task (<task>.pt)")
    mk.add_argument("dir", nargs="?", default=None,
                    help=f"where to write them (default: ${HEADS_ENV}, or {DEFAULT_HEADS_DIR})")
    args = parser.parse_args(argv)
    for path in make_heads(args.dir or heads_dir()):
        print(f"wrote {path} ({len(TASKS[path.stem])} classes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
