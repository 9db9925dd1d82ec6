"""Built-in datasets, generated from the seed: no downloads, identical everywhere.

Every row is a pure function of ``(seed, id)``, so a worker, the evaluator and
a test regenerate exactly the same sample without shipping data around.
``synthetic`` is 10 classes of 3x32x32 images: each class has its own smooth
colour pattern, each image is that pattern shifted by a few pixels, scaled and
buried in noise (signal-to-noise about 0.16). A small CNN climbs from chance
(0.1) to above 0.9 in a few epochs. ``synthetic-tabular`` is 10 Gaussian clusters in 32 dimensions.
``synthetic-tokens`` is sequences for a language model: each counts up from a
random token with its own stride (1 to 4, modulo the vocabulary), with one
token in ten replaced by noise; a model that infers the stride from the
context predicts most next tokens (a unigram model cannot: loss ln 64 = 4.16).
"""

from __future__ import annotations

import numpy as np

NUM_CLASSES = 10
IMAGE_SHAPE = (3, 32, 32)
FEATURE_NAMES = tuple(f"f{i}" for i in range(32))  # tabular rows: one column per feature
VOCAB_SIZE = 64
SEQUENCE_LENGTH = 32  # tokens the model reads; a row holds one more, the last target
TOKEN_NOISE = 0.1


def _class_patterns(seed: int) -> np.ndarray:
    """One smooth 3x32x32 pattern per class, values around [-1, 1]."""
    rng = np.random.default_rng([seed, 0x5EED])
    coarse = rng.standard_normal((NUM_CLASSES, 3, 4, 4))
    return np.kron(coarse, np.ones((1, 1, 8, 8))).astype(np.float32)  # 4x4 -> 32x32 blocks


def _tabular_centres(seed: int) -> np.ndarray:
    rng = np.random.default_rng([seed, 0x7AB])
    return rng.standard_normal((NUM_CLASSES, len(FEATURE_NAMES))).astype(np.float32)


def image_rows(ids: np.ndarray, seed: int) -> dict[str, np.ndarray]:
    """Rows ``{"id", "image" (uint8 CHW), "label"}`` for the given ids."""
    patterns = _class_patterns(seed)
    images = np.empty((len(ids), *IMAGE_SHAPE), dtype=np.uint8)
    labels = np.empty(len(ids), dtype=np.int64)
    for i, row_id in enumerate(ids):
        rng = np.random.default_rng([seed, int(row_id)])
        label = int(rng.integers(NUM_CLASSES))
        shift = rng.integers(-4, 5, size=2)
        pattern = np.roll(patterns[label], shift=tuple(shift), axis=(1, 2))
        pixels = 128 + 13 * rng.uniform(0.6, 1.4) * pattern + 80 * rng.standard_normal(IMAGE_SHAPE)
        images[i] = np.clip(pixels, 0, 255).astype(np.uint8)
        labels[i] = label
    return {"id": ids.astype(np.int64), "image": images, "label": labels}


def tabular_rows(ids: np.ndarray, seed: int) -> dict[str, np.ndarray]:
    """Rows ``{"id", "f0".."f31" (float32), "label"}`` for the given ids."""
    centres = _tabular_centres(seed)
    features = np.empty((len(ids), len(FEATURE_NAMES)), dtype=np.float32)
    labels = np.empty(len(ids), dtype=np.int64)
    for i, row_id in enumerate(ids):
        rng = np.random.default_rng([seed, int(row_id)])
        label = int(rng.integers(NUM_CLASSES))
        features[i] = centres[label] + 1.2 * rng.standard_normal(len(FEATURE_NAMES))
        labels[i] = label
    columns = {name: features[:, i] for i, name in enumerate(FEATURE_NAMES)}
    return {"id": ids.astype(np.int64), **columns, "label": labels}


def token_rows(ids: np.ndarray, seed: int) -> dict[str, np.ndarray]:
    """Rows ``{"id", "tokens" (int64, SEQUENCE_LENGTH + 1), "label" (the stride)}`` for the given ids."""
    tokens = np.empty((len(ids), SEQUENCE_LENGTH + 1), dtype=np.int64)
    strides = np.empty(len(ids), dtype=np.int64)
    for i, row_id in enumerate(ids):
        rng = np.random.default_rng([seed, int(row_id)])
        strides[i] = rng.integers(1, 5)
        tokens[i] = (rng.integers(VOCAB_SIZE) + strides[i] * np.arange(SEQUENCE_LENGTH + 1)) % VOCAB_SIZE
        noisy = rng.random(SEQUENCE_LENGTH + 1) < TOKEN_NOISE
        tokens[i, noisy] = rng.integers(VOCAB_SIZE, size=int(noisy.sum()))
    return {"id": ids.astype(np.int64), "tokens": tokens, "label": strides}


GENERATORS = {"synthetic": image_rows, "synthetic-tabular": tabular_rows, "synthetic-tokens": token_rows}


def split_ids(train_size: int, val_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Train and val ids never overlap: val rows follow the training rows."""
    return np.arange(train_size), np.arange(train_size, train_size + val_size)
