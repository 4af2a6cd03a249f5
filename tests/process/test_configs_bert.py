"""configs/bert_shared.json and its models (configs/bert_tasks.py), run as README "Bring your
own model" shows them (issue 43 item 4): export each task with the README's own `blockflow
export` line, serve the update, and every task's served answer is its stock ``transformers``
model's run directly, at two sequence lengths over both transports; the sharing saves
parameter bytes against three whole models (experiments/memory_model.py ``sharing``).

The README's commands write into model_repo/, and so do these tests (once per checkout, shared with
``python -m experiments.transformers``)."""
from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from blockflow.blocks.repository import load_manifest
from blockflow.client import Client
from conftest import MODEL_REPO, ROOT, needs
import test_configs_example as configs_example
from experiments.memory_model import sharing
from experiments.transformers import ensure_bert_tasks, sharing_export_args

pytestmark = needs("transformers")

CONFIG = os.path.join(ROOT, "configs", "bert_shared.json")
#: Largest difference accepted between a served task and its model run directly (issue 43's goal).
TOL = 1e-5


def readme_export_args(task: str, out: str) -> list[str]:
    return configs_example.readme_export_args(task, out, "bert_tasks")


@pytest.fixture(scope="module")
def bert_tasks():
    """configs/bert_tasks.py, imported by the tests that use it: it imports transformers (6 s of
    CPU), which a pytest process that only collects this file need not pay."""
    from configs import bert_tasks
    return bert_tasks


@pytest.fixture(scope="module")
def exported(bert_tasks):
    """model_repo/, where the README's `blockflow export` line writes the three tasks: exported
    there once per checkout (``ensure_bert_tasks``, which the transformers experiment shares; a
    lock per task, so two pytest workers export each task once), with exactly the README's
    arguments."""
    for task in bert_tasks.TASKS:
        assert sharing_export_args(task, MODEL_REPO) == readme_export_args(task, MODEL_REPO), task
    return ensure_bert_tasks(MODEL_REPO)


def test_the_shared_encoder_is_the_same_bytes_in_every_export_and_the_heads_differ(exported, bert_tasks):
    manifests = {t: load_manifest(exported, f"bert_{t}") for t in bert_tasks.TASKS}
    sums = {t: m["blocks"]["block1.pt"]["sha256"] for t, m in manifests.items()}
    assert len(set(sums.values())) == 1, sums
    on_disk = {hashlib.sha256(open(os.path.join(exported, f"bert_{t}", "block1.pt"), "rb").read()).hexdigest()
               for t in bert_tasks.TASKS}
    assert on_disk == set(sums.values())
    heads = {t: m["blocks"]["block2.pt"] for t, m in manifests.items()}
    assert len({h["sha256"] for h in heads.values()}) == len(heads)
    first = manifests["classify"]["blocks"]["block1.pt"]
    assert first["input_names"] == ["input_ids", "attention_mask"] and first["input_dtypes"] == ["int64", "int64"]
    assert first["dim_bounds"]["S"] == [2, 128]
    assert heads["classify"]["output_keys"] == ["logits"] and heads["tag"]["output_dims"] == [["N", "S", 5]]
    assert heads["embed"]["output_dims"] == [["N", 64]]


def test_sharing_the_encoder_saves_its_parameters_twice_against_three_whole_models(exported, bert_tasks):
    with open(CONFIG) as f:
        update = json.load(f)
    saved = sharing(exported, update)
    print(f"\nbert_shared.json: {saved['served_bytes'] / 1e6:.2f} MB of parameters served, "
          f"{saved['whole_models_bytes'] / 1e6:.2f} MB in three whole models: {saved['saving_pct']:.1f} % less")
    encoder = load_manifest(exported, "bert_classify")["blocks"]["block1.pt"]["param_bytes"]
    assert saved["shared_files"] == ["bert_classify/block1.pt"] and saved["shared_bytes"] == encoder
    heads = sum(load_manifest(exported, f"bert_{t}")["blocks"]["block2.pt"]["param_bytes"] for t in bert_tasks.TASKS)
    assert saved["served_bytes"] == encoder + heads
    # a whole model holds the encoder and its own head: serving the encoder once saves two copies
    assert saved["whole_models_bytes"] == pytest.approx(3 * encoder + heads, rel=1e-3)
    assert saved["saving_pct"] == pytest.approx(100 * 2 * encoder / saved["whole_models_bytes"], rel=1e-2)
    assert (saved["processes"], saved["whole_model_processes"]) == (4, 3)


def direct(bert_tasks, task: str, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = bert_tasks.build(task)(input_ids=ids, attention_mask=mask)
    return out if isinstance(out, torch.Tensor) else out.logits


@pytest.mark.parametrize("transport", ["tensormq", "zeromq"])
def test_the_config_serves_each_task_as_its_model_run_directly(server_factory, exported, bert_tasks, transport):
    """All three tasks at once through the one encoder process, at two sequence lengths (the
    same blocks), each within 1e-5 of the stock model run directly."""
    with open(CONFIG) as f:
        update = json.load(f)
    assert update["transport"] == "tensormq"
    update["transport"] = transport
    srv = server_factory(exported)
    res = srv.call("POST", "/system/update", update, timeout=240)
    assert sorted(res["diff"]["tasks"]["added"]) == sorted(bert_tasks.TASKS)
    assert len({t["path"][0] for t in update["tasks"]}) == 1, "the three tasks share their first block"
    gen = torch.Generator().manual_seed(43)
    for batch, seq in ((1, 9), (3, 40)):
        ids = torch.randint(0, bert_tasks.CONFIG["vocab_size"], (batch, seq), generator=gen)
        mask = torch.ones(batch, seq, dtype=torch.int64)
        mask[-1, seq // 2:] = 0  # padding in one sequence: the mask changes the answer
        want = {t: direct(bert_tasks, t, ids, mask) for t in bert_tasks.TASKS}

        def infer(task):
            with Client(srv.dispatcher, timeout=120) as c:
                y = c.infer(task, (ids, mask))
            return y["logits"] if isinstance(y, dict) else y

        with ThreadPoolExecutor(len(bert_tasks.TASKS)) as pool:
            got = dict(zip(bert_tasks.TASKS, pool.map(infer, bert_tasks.TASKS)))
        shapes = {"classify": (batch, 3), "tag": (batch, seq, 5), "embed": (batch, 64)}
        for task, y in got.items():
            assert tuple(y.shape) == shapes[task] == tuple(want[task].shape), (task, y.shape)
            assert (y - want[task]).abs().max().item() <= TOL, (task, batch, seq)
