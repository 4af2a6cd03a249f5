"""Three text tasks on one small BERT-style encoder: the models behind ``configs/bert_shared.json``
and README "Bring your own model" (a Hugging Face model, one encoder, three heads).

Each task is a stock ``transformers`` model built from :data:`CONFIG` (4 layers, hidden size
64; nothing downloaded), whose first two encoder layers and embeddings are the same weights
in all three, and whose last two layers and head are the task's own (fine-tuned, in a real
deployment)::

    classify  BertForSequenceClassification: {"logits": [N, 3]}   (negative, neutral, positive)
    tag       BertForTokenClassification:    {"logits": [N, S, 5]} (O, PER, ORG, LOC, MISC)
    embed     Embedder: BertModel's pooled output, L2-normalised: [N, 64] (a sentence
              embedding: the first token's last hidden state through a dense layer and tanh)

``blockflow export --model configs.bert_tasks:$task --cut bert.encoder.layer.1 --input ...``
(run from the repository root, which the export puts on ``sys.path``) splits a task's model
into block1 (embeddings and layers 0-1: the shared encoder) and block2 (layers 2-3 and the
task's head).  The shared weights are drawn from their own seed (:data:`SHARED_SEED`) and the
task's own from a seed of the task's name, whatever the export's ``--seed``, so the three
exports' block1 are the same weights: one process serves all three tasks, and only block2
differs.  Nothing is trained: the weights are seeded stand-ins for a checkpoint.
"""
import zlib

import torch
from torch import nn
from transformers import BertConfig, BertForSequenceClassification, BertForTokenClassification, BertModel

#: The encoder: small enough for the CPU box.
CONFIG = dict(vocab_size=1000, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
              intermediate_size=128, max_position_embeddings=128)
#: How many of the encoder's layers (after the embeddings) the tasks share.
SHARED_LAYERS = 2
#: The seed of the shared weights (embeddings and the first SHARED_LAYERS layers).
SHARED_SEED = 43
#: The tasks and their labels (``embed`` has none: it returns a vector).
TASKS: dict[str, tuple[str, ...]] = {
    "classify": ("negative", "neutral", "positive"),
    "tag": ("O", "PER", "ORG", "LOC", "MISC"),
    "embed": (),
}
#: The cut after the shared layers, as ``--cut`` names it.
CUT = f"bert.encoder.layer.{SHARED_LAYERS - 1}"


class Embedder(nn.Module):
    """The encoder's pooled output (BERT's pooler: the first token's last hidden state through
    a dense layer and tanh), L2-normalised.  Its pooling uses no input beyond the encoder's:
    the mask crosses no cut, so its first block is the other tasks' (a mean over the mask
    would hand the mask on too)."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.bert = BertModel(config)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        pooled = self.bert(input_ids=input_ids, attention_mask=attention_mask).pooler_output
        return nn.functional.normalize(pooled, dim=-1)


def task_seed(task: str) -> int:
    """Each task's own seed (a checksum of its name), so the tasks' own weights differ."""
    return zlib.crc32(task.encode())


def shared_state() -> dict[str, torch.Tensor]:
    """The shared weights: the embeddings and first :data:`SHARED_LAYERS` layers of a BertModel
    drawn from :data:`SHARED_SEED` (torch's global generator is left as it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SHARED_SEED)
        encoder = BertModel(BertConfig(**CONFIG), add_pooling_layer=False)
    shared = ("embeddings.", *(f"encoder.layer.{i}." for i in range(SHARED_LAYERS)))
    return {k: v for k, v in encoder.state_dict().items() if k.startswith(shared)}


def build(task: str) -> nn.Module:
    """``task``'s model in eval mode: its own weights from its seed, then the shared ones."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; the tasks are {', '.join(TASKS)}")
    config = BertConfig(**CONFIG, num_labels=max(len(TASKS[task]), 1))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(task_seed(task))
        net = {"classify": BertForSequenceClassification, "tag": BertForTokenClassification,
               "embed": Embedder}[task](config)
    state = shared_state()
    missing = set(state) - set(net.bert.state_dict())
    if missing:  # a bug here, not the user's: the shared names are BertModel's
        raise RuntimeError(f"{task}: the encoder has no {sorted(missing)[:3]}")
    net.bert.load_state_dict(state, strict=False)
    return net.eval()


def classify() -> nn.Module:
    """``--model configs.bert_tasks:classify``"""
    return build("classify")


def tag() -> nn.Module:
    """``--model configs.bert_tasks:tag``"""
    return build("tag")


def embed() -> nn.Module:
    """``--model configs.bert_tasks:embed``"""
    return build("embed")
