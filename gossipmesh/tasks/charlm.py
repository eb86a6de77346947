"""A tiny character-level transformer language model on text that ships with Python.

The text is the standard library's pydoc topics (``pydoc_data.topics``: about 80 help pages,
~460k characters), so nothing is downloaded. The vocabulary is fixed (printable ASCII, newline
and one token for anything else), so every node builds the same model whatever its Python
version. Examples are non-overlapping windows; the topic a window comes from is its label for
``dirichlet:ALPHA`` partitioning (topic skew), and a seeded tenth of the windows is held out.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.nn import functional

from gossipmesh.tasks.base import DataPartition, Evaluation, Shard, device_of, evaluating, partition_indices

CONTEXT = 32  # characters a prediction may look back on
VOCAB = ["\n", *map(chr, range(32, 127))]
UNKNOWN = len(VOCAB)  # the token of every other character
VOCAB_SIZE = len(VOCAB) + 1
SPLIT_SEED = 0
TEST_FRACTION = 0.1
MAX_TEST_WINDOWS = 128  # evaluated at every timeline point: keep it tens of milliseconds


def pydoc_topics() -> list[str]:
    """The help pages, in a fixed order."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # pragma: no cover - some distributions split it out
        raise FileNotFoundError(
            "the charlm task reads the standard library's pydoc_data; install your distribution's "
            "full Python (e.g. Debian's libpython3-stdlib) or use --task digits"
        ) from None
    return [topics[key] for key in sorted(topics)]


def encode(text: str) -> np.ndarray:
    lookup = np.full(0x110000, UNKNOWN, dtype=np.int64)
    lookup[[ord(c) for c in VOCAB]] = np.arange(len(VOCAB))
    return lookup[np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)]


class TinyTransformer(nn.Module):
    """A causal transformer: 2 pre-norm layers of width 64, 4 heads (82k parameters)."""

    def __init__(self, width: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB_SIZE, width)
        self.position = nn.Parameter(torch.randn(CONTEXT, width) * 0.02)
        layer = nn.TransformerEncoderLayer(
            width, heads, dim_feedforward=2 * width, dropout=0.0, batch_first=True, norm_first=True
        )
        self.layers = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB_SIZE)
        self.causal: torch.Tensor
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(CONTEXT))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        hidden = self.embed(tokens) + self.position[:length]
        mask = self.causal[:length, :length]
        logits: torch.Tensor = self.head(self.norm(self.layers(hidden, mask=mask, is_causal=True)))
        return logits


class CharLMTask:
    """Next-character prediction; accuracy is the share of held-out characters predicted."""

    name = "charlm"

    def __init__(self) -> None:
        windows, topics = [], []
        for topic, text in enumerate(pydoc_topics()):
            tokens = encode(text)
            count = len(tokens) // (CONTEXT + 1)
            windows.append(tokens[: count * (CONTEXT + 1)].reshape(count, CONTEXT + 1))
            topics.append(np.full(count, topic))
        data = torch.from_numpy(np.concatenate(windows))
        self._topics = np.concatenate(topics)
        order = np.random.default_rng(SPLIT_SEED).permutation(len(data))
        cut = int(len(data) * TEST_FRACTION)
        test, train = np.sort(order[:cut][:MAX_TEST_WINDOWS]), np.sort(order[cut:])
        self._train, self._train_topics = data[train], self._topics[train]
        self._test = data[test]

    def model(self, seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return TinyTransformer()

    def shard(self, rank: int, num_shards: int, *, partition: DataPartition, seed: int) -> Shard:
        parts = partition_indices(self._train_topics, num_shards, partition, seed)
        windows = self._train[torch.from_numpy(parts[rank])]
        return Shard(windows[:, :-1], windows[:, 1:], labels=self._train_topics[parts[rank]])

    def loss(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return functional.cross_entropy(model(inputs).reshape(-1, VOCAB_SIZE), targets.reshape(-1))

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> Evaluation:
        test = self._test.to(device_of(model))
        with evaluating(model):
            logits = model(test[:, :-1]).reshape(-1, VOCAB_SIZE)
        targets = test[:, 1:].reshape(-1)
        return Evaluation(
            loss=float(functional.cross_entropy(logits, targets)),
            accuracy=float((logits.argmax(dim=1) == targets).float().mean()),
        )
