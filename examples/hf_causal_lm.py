"""A Hugging Face causal language model on a Hugging Face dataset, trained with DDP or FSDP: nothing downloaded.

    pip install 'raytrain-ddp[hf]'
    cd examples && python hf_causal_lm.py                    # 2 CPU workers, DDP
    python hf_causal_lm.py --strategy fsdp                   # each decoder layer one FSDP unit
    python -m raytrain_ddp.run --model hf_causal_lm:build_model --dataset hf_causal_lm:build_datasets \\
        --optimizer adamw --lr 0.003 --checkpoint-metric val_loss
    HF_EXAMPLE_TEXT=my.txt python hf_causal_lm.py            # your own text, one passage per line

Any trainer flag after the script name overrides the settings below.

`--model hf_causal_lm:build_model`: a `transformers` Llama built from a small
`LlamaConfig` (random weights, no checkpoint fetched). A transformers model
returns an output object; the project's loop and loss take a tensor, so a thin
wrapper returns its `.logits` ([batch, length, vocab]), and the default loss,
cross-entropy over the last dimension, is next-token prediction as for the
built-in transformer. With --strategy fsdp the project shards every module
whose class the model lists in `_no_split_modules` (here `LlamaDecoderLayer`)
as one unit, then the root.

`--dataset hf_causal_lm:build_datasets`, on the driver: a text file (written
here unless HF_EXAMPLE_TEXT names one) becomes a `datasets.Dataset`, tokenised
by a BPE tokenizer trained on that same text with `tokenizers`, cut into
blocks of SEQUENCE_LENGTH + 1 tokens (x: the first SEQUENCE_LENGTH, y: the
same shifted by one), and handed to Ray Data with `ray.data.from_huggingface`;
the project shards it per rank and reshuffles it every epoch.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything below is built here: the Hub is never asked

import random
import sys
import tempfile
from pathlib import Path

import datasets
import numpy as np
import ray.data
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB_SIZE = 128  # the tokenizer's at most, and the model's
SEQUENCE_LENGTH = 32
datasets.disable_progress_bars()  # a run's log holds the project's progress lines, not datasets' bars
WORDS = {
    "name": ["ana", "ben", "cleo", "dev", "eli", "fay"],
    "pet": ["cat", "dog", "bird", "fish"],
    "colour": ["red", "blue", "green", "yellow"],
    "place": ["garden", "kitchen", "park", "river"],
}


class CausalLM(nn.Module):
    """tokens [batch, length] -> next-token logits [batch, length, vocab], as the built-in transformer."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.lm = LlamaForCausalLM(config)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=tokens).logits


def build_model(config) -> nn.Module:
    return CausalLM(
        LlamaConfig(
            vocab_size=VOCAB_SIZE,
            hidden_size=64,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=SEQUENCE_LENGTH,
            use_cache=False,  # training: no key/value cache to keep
        )
    )


def write_stories(path: Path, lines: int, seed: int) -> None:
    """Short stories from a small grammar: the pet's colour and place come back later in the line."""
    rng = random.Random(seed)
    with path.open("w") as file:
        for _ in range(lines):
            name, pet, colour, place = (rng.choice(WORDS[key]) for key in ("name", "pet", "colour", "place"))
            file.write(
                f"{name} has a {colour} {pet} . the {pet} sleeps in the {place} . "
                f"{name} finds the {colour} {pet} in the {place} .\n"
            )


def train_tokenizer(lines) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        limit_alphabet=VOCAB_SIZE // 2,  # a text of many characters still gives ids below VOCAB_SIZE: the rest [UNK]
        special_tokens=["[UNK]", "[EOS]"],
        show_progress=False,
    )
    tokenizer.train_from_iterator(lines, trainer=trainer)
    return tokenizer


def build_datasets(config) -> dict:
    """--train-size and --val-size blocks of SEQUENCE_LENGTH + 1 tokens, from the text, as Ray Datasets."""
    block = SEQUENCE_LENGTH + 1
    wanted = config.train_size + config.val_size
    with tempfile.TemporaryDirectory() as scratch:  # datasets' cache: gone once the rows are in memory
        text_file = os.environ.get("HF_EXAMPLE_TEXT")
        if not text_file:
            text_file = os.path.join(scratch, "stories.txt")
            write_stories(
                Path(text_file), lines=wanted * block // 16 + 1, seed=config.seed
            )  # ~23 tokens a line: room for what map batches drop
        text = datasets.Dataset.from_text(text_file, cache_dir=scratch, keep_in_memory=True)
        tokenizer = train_tokenizer(text["text"])
        eos = tokenizer.token_to_id("[EOS]")

        def tokenise(batch: dict) -> dict:
            return {"ids": [encoding.ids + [eos] for encoding in tokenizer.encode_batch(batch["text"])]}

        def blocks(batch: dict) -> dict:
            ids = [token for row in batch["ids"] for token in row]
            cut = [ids[at : at + block] for at in range(0, len(ids) - block + 1, block)]
            return {"x": [tokens[:-1] for tokens in cut], "y": [tokens[1:] for tokens in cut]}

        tokens = text.map(tokenise, batched=True, remove_columns=["text"], keep_in_memory=True)
        rows = tokens.map(blocks, batched=True, remove_columns=["ids"], keep_in_memory=True)
    if len(rows) < wanted:
        raise ValueError(
            f"{text_file} gives {len(rows)} blocks of {block} tokens, fewer than --train-size + --val-size = {wanted}"
        )
    return {
        "train": to_ray(rows.select(range(config.train_size))),
        "val": to_ray(rows.select(range(config.train_size, wanted))),
    }


def to_ray(rows: datasets.Dataset) -> ray.data.Dataset:
    # Ray Data hands a list column over as an array of arrays: one [rows, SEQUENCE_LENGTH] array per column
    return ray.data.from_huggingface(rows).map_batches(
        lambda batch: {name: np.stack(values) for name, values in batch.items()}, batch_format="numpy"
    )


if __name__ == "__main__":
    from raytrain_ddp.run import main

    sys.exit(
        main(
            [
                "--model",
                "hf_causal_lm:build_model",
                "--dataset",
                "hf_causal_lm:build_datasets",
                "--optimizer",
                "adamw",
                "--lr",
                "0.003",
                "--checkpoint-metric",
                "val_loss",  # a language model is judged by its loss (as the built-in one is)
                "--epochs",
                "2",
                "--train-size",
                "2048",
                "--val-size",
                "256",
                "--batch-size",
                "32",
                "--name",
                "hf-lm",
                *sys.argv[1:],
            ]
        )
    )
