"""What ``blockflow update`` prints for a person (``format_update``), from answers the server gives."""
from __future__ import annotations

from blockflow.cli import STATUS_WIDTH, format_update


def _answer(**shm):
    return {"version": 7, "seconds": 1.234,
            "diff": {"spawned": ["b1", "b2"], "replaced": ["h"], "kept": [], "removed": ["old"],
                     "tasks": {"added": ["t"], "removed": [], "changed": ["u"]}},
            "shm": {"dir": "/dev/shm/blockflow-0-abc", "window": 8, "edges": 4, "edges_unknown_size": 0,
                    "needed_bytes_batch1": 64 << 20, "size_bytes": 1 << 30, "free_bytes": 512 << 20, "fits": True,
                    **shm}}


def test_an_update_is_summed_up_in_lines_that_fit():
    text = format_update(_answer())
    assert text.splitlines() == [
        "applied update version 7 in 1.23 s",
        "processes: spawned b1, b2; replaced h; kept -; removed old",
        "tasks: added t; changed u; removed -",
        "TensorMQ slots: 64.0 MiB at batch 1 for 4 edges x 8 slots; 512 MiB free in /dev/shm"]


def test_slots_that_do_not_fit_say_what_to_do():
    text = format_update(_answer(fits=False, free_bytes=16 << 20, edges_unknown_size=1))
    flat = " ".join(text.split())
    assert "64.0 MiB at batch 1 for 4 edges x 8 slots (1 of unknown size); 16 MiB free in /dev/shm" in flat, text
    assert "DOES NOT FIT" in flat and "no_shared_memory" in flat and "BLOCKFLOW_SHM_DIR" in flat, text
    assert all(len(line) <= STATUS_WIDTH for line in text.splitlines()), text


def test_a_zeromq_update_has_no_slot_line():
    answer = _answer()
    answer["shm"] = {**answer["shm"], "edges": 0, "needed_bytes_batch1": 0}
    assert "TensorMQ" not in format_update(answer)
    answer["shm"] = None
    assert len(format_update(answer).splitlines()) == 3


def test_a_long_path_or_hyphenated_name_is_never_split_across_lines():
    # CI's shared-memory folders are named like /dev/shm/bfw-gw1-js2dfn6r: a wrap at the hyphen
    # gave a path that could not be copied from the terminal
    shm_dir = "/dev/shm/bfw-gw1-js2dfn6r-" + "x" * 40 + "/slots"
    answer = _answer(dir=shm_dir, edges_unknown_size=4)
    answer["diff"]["spawned"] = [f"resnet50-block-{i}" for i in range(12)]
    words = " ".join(format_update(answer).split()).split(" ")
    assert "/dev/shm/bfw-gw1-js2dfn6r-" + "x" * 40 in words
    assert all(f"resnet50-block-{i}," in words for i in range(11)) and "resnet50-block-11;" in words
