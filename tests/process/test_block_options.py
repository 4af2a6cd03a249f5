"""A block option is declared once (Note [One declaration per block] in blockflow/core/schema.py) and
acts where it is read. ``input_dtype`` (issue 43's inputs as the model takes them): a block whose
model embeds token ids warms up on int64 ids, and the task it starts refuses float tensors.
Real server, real block processes."""
from __future__ import annotations

import msgspec
import pytest
import torch

from blockflow.blocks.spec import BlockSpec
from blockflow.client import BlockFlowError, Client
from blockflow.core.protocol import ErrorCode
from blockflow.core.schema import BLOCK_FIELDS, BlockDecl, UpdateError, validate_update

from test_control_plane import rest_error


class Embed(torch.nn.Module):
    """Token ids in, vectors out: an int64 input, as a transformer's first layer takes it."""

    def __init__(self):
        super().__init__()
        self.table = torch.nn.Embedding(16, 4)

    def forward(self, ids):
        return self.table(ids)


@pytest.fixture(scope="module")
def embed_repo(tmp_path_factory):
    torch.manual_seed(0)
    model = Embed().eval()
    repo = tmp_path_factory.mktemp("embed_repo")
    (repo / "toy").mkdir()
    torch.jit.save(torch.jit.script(model), str(repo / "toy" / "embed.pt"))
    return str(repo), model


def _update(**options) -> dict:
    block = {"name": "e", "model": "toy/embed.pt", "threads": 1, "warmup_shapes": [[1, 8]], **options}
    return {"blocks": [block], "tasks": [{"id": "t", "path": ["e"]}]}


def test_every_declared_option_reaches_the_block_spec():
    """The spec a block process gets carries every field of the declaration, whatever is added
    to it: the manager passes the declaration whole, and the spec's JSON brings it back typed."""
    decl = validate_update(_update(input_dtype="int64", cuda_graphs=False,
                                   batching={"max_batch": 4, "max_queue_delay_us": "auto"})).blocks["e"]
    spec = BlockSpec(**msgspec.structs.asdict(decl), repo="r", run_dir="r", sock_dir="s")
    again = BlockSpec.from_json(spec.to_json())
    assert set(BLOCK_FIELDS) <= set(BlockSpec.__struct_fields__)
    assert {f: getattr(again, f) for f in BLOCK_FIELDS} == msgspec.structs.asdict(decl)
    assert isinstance(again, BlockDecl) and again.batching.auto


def test_input_dtype_is_refused_by_name_when_it_is_not_a_dtype():
    with pytest.raises(UpdateError) as info:
        validate_update(_update(input_dtype="int3"))
    assert info.value.field == "blocks[0].input_dtype" and "int64" in info.value.message, info.value


def test_input_dtype_warms_the_block_on_ids_and_its_task_refuses_floats(server_factory, embed_repo):
    repo, model = embed_repo
    srv = server_factory(repo)
    # without it the block warms up on float32 zeros, which an embedding refuses: it cannot start
    err = rest_error(srv, "POST", "/system/update", _update())
    assert err.status == 422 and err.body["block"] == "e" and "warm-up" in err.body["error"], err.body
    srv.call("POST", "/system/update", _update(input_dtype="int64"), timeout=120)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 15]])
    with Client(srv.dispatcher, timeout=30) as c:
        assert torch.equal(c.infer("t", ids), model(ids))
        with pytest.raises(BlockFlowError) as info:
            c.infer("t", ids.float())
    assert info.value.code == ErrorCode.BAD_INPUT and "int64" in str(info.value), info.value
