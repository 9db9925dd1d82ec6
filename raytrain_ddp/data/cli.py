"""Command line: convert sources into datasets (`prepare`) and look at them (`inspect`).

    python -m raytrain_ddp.data prepare --from imagefolder ./images --out /shared/ds --val-fraction 0.1
    python -m raytrain_ddp.data prepare --from cifar10 ~/data/cifar-10-batches-py --out /shared/cifar10
    python -m raytrain_ddp.data prepare --from csv table.csv --label-column species --out /shared/iris
    python -m raytrain_ddp.data inspect /shared/ds

Bad input ends with one line `error: ...` on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

import numpy as np
from PIL import Image

from raytrain_ddp.data import prepare
from raytrain_ddp.data.format import DEFAULT_ROW_GROUP_SIZE, DEFAULT_ROWS_PER_FILE, DatasetInfo, decode_images
from raytrain_ddp.data.paths import resolve
from raytrain_ddp.data.validate import check_dataset, open_parquet
from raytrain_ddp.errors import ConfigError, OneLineErrorParser, bad_input

SOURCES = ("imagefolder", "cifar10", "csv")
ASCII_RAMP = " .:-=+*#%@"  # dark to bright
THUMBNAIL_MAX_WIDTH = 24  # pixels; each is drawn as two characters
MAX_CLASSES_SHOWN = 20


PROG = "python -m raytrain_ddp.data"
PREPARE_EXAMPLES = """\
examples:
  %(prog)s --from imagefolder ./images --out /shared/ds --val-fraction 0.1
  %(prog)s --from cifar10 ~/data/cifar-10-batches-py --out /shared/cifar10
  %(prog)s --from csv table.csv --label-column species --out /shared/iris
"""


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """prog: the command's name in --help (`raytrain-ddp` for `raytrain-ddp prepare|inspect`)."""
    parser = OneLineErrorParser(prog=prog, description=__doc__.split("\n")[0], allow_abbrev=False)
    commands = parser.add_subparsers(dest="command", required=True)

    convert = commands.add_parser(
        "prepare",
        help="convert a source into a Parquet dataset",
        description="Convert an image folder, CIFAR-10's python batches or a CSV file into a Parquet dataset.",
        epilog=PREPARE_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    convert.add_argument("--from", dest="source_kind", choices=SOURCES, required=True, help="source format")
    convert.add_argument("source", help="image folder root, CIFAR-10 python directory, or CSV file")
    convert.add_argument("--out", required=True, help="dataset directory to create")
    convert.add_argument("--val-fraction", type=float, help="share of each class put in val (default 0.1; not cifar10)")
    convert.add_argument("--seed", type=int, default=0, help="seed of the train/val split (default 0)")
    convert.add_argument("--image-size", type=int, help="imagefolder: resize and centre-crop to SIZE x SIZE")
    convert.add_argument("--label-column", help="csv: the column holding the class")
    convert.add_argument("--overwrite", action="store_true", help="replace an existing dataset at --out")
    convert.add_argument("--rows-per-file", type=int, default=DEFAULT_ROWS_PER_FILE)
    convert.add_argument("--row-group-size", type=int, default=DEFAULT_ROW_GROUP_SIZE)

    show = commands.add_parser(
        "inspect",
        help="check a dataset and describe it",
        description="Check a dataset and print its schema, rows, classes, size and a decoded sample.",
        epilog="example:\n  %(prog)s /shared/ds",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    show.add_argument("path", help="dataset directory, Parquet file, directory, glob or URI")
    return parser


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    args = build_parser(prog).parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        if args.command == "prepare":
            _prepare(args)
        else:
            _inspect(args.path)
    except ConfigError as exc:
        return bad_input(exc)
    return 0


def _prepare(args: argparse.Namespace) -> None:
    layout = {"rows_per_file": args.rows_per_file, "row_group_size": args.row_group_size}
    if args.image_size is not None and args.source_kind != "imagefolder":
        raise ConfigError("--image-size applies only to --from imagefolder")
    if args.label_column is not None and args.source_kind != "csv":
        raise ConfigError("--label-column applies only to --from csv")
    val_fraction = 0.1 if args.val_fraction is None else args.val_fraction
    if args.source_kind == "imagefolder":
        prepare.from_imagefolder(
            args.source, args.out, val_fraction, args.seed, args.image_size, args.overwrite, **layout
        )
    elif args.source_kind == "cifar10":
        if args.val_fraction is not None:
            raise ConfigError("--val-fraction does not apply to cifar10: its test_batch is the val split")
        prepare.from_cifar10(args.source, args.out, args.overwrite, **layout)
    else:
        if args.label_column is None:
            raise ConfigError("--from csv needs --label-column")
        prepare.from_csv(args.source, args.out, args.label_column, val_fraction, args.seed, args.overwrite, **layout)


# ---------------------------------------------------------------- inspect


def _inspect(path: str) -> None:
    info = check_dataset(path)
    print(f"dataset    {info.path}")
    print(f"kind       {info.kind}")
    shown = ", ".join(info.classes[:MAX_CLASSES_SHOWN]) + (" ..." if info.num_classes > MAX_CLASSES_SHOWN else "")
    print(f"classes    {info.num_classes}: {shown}")
    if info.kind == "image":
        print(f"images     {_shape_text(info.image_shape)} (CxHxW), {info.encoding}")
    else:
        print(f"features   {', '.join(info.feature_columns or [])}")
    print(f"mean       {_numbers(info.mean)}")
    print(f"std        {_numbers(info.std)}")
    if constant := info.constant_inputs():
        print(f"constant   {', '.join(constant)} (std 0 over the train split: training scales them by 1)")
    print(f"{'split':<10} {'rows':>10} {'files':>6} {'row groups':>11} {'rows/group':>13} {'size':>10}")
    for split, paths in (("train", info.train_paths), ("val", info.val_paths)):
        _print_split(split, info.rows[split], paths)
    _print_sample(info)


def _print_split(split: str, rows: int, paths: Sequence[str]) -> None:
    group_rows: list[int] = []
    size = 0
    for path in paths:
        location = resolve(path)
        size += location.filesystem.get_file_info(location.path).size
        with open_parquet(location) as parquet:
            metadata = parquet.metadata
            group_rows += [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)]
    spread = f"{min(group_rows)}..{max(group_rows)}" if group_rows else "-"
    print(f"{split:<10} {rows:>10} {len(paths):>6} {len(group_rows):>11} {spread:>13} {_bytes_text(size):>10}")


def _print_sample(info: DatasetInfo) -> None:
    """Decode the first train row: proves the data reads back, and shows what it looks like."""
    with open_parquet(resolve(info.train_paths[0])) as parquet:
        print(f"schema     {', '.join(f'{field.name}: {field.type}' for field in parquet.schema_arrow)}")
        row = next(parquet.iter_batches(batch_size=1)).to_pylist()[0]
    label = row.get("label")
    class_name = info.classes[label] if isinstance(label, int) and 0 <= label < info.num_classes else "?"
    if info.kind == "tabular":
        values = ", ".join(f"{name}={row[name]}" for name in info.feature_columns or [])
        print(f"sample     id {row.get('id')}, label {label} ({class_name}): {values}")
        return
    pixels = decode_images([row["image"]], info.encoding or "png", info.image_shape or ())[0].transpose(1, 2, 0)
    shape = _shape_text((pixels.shape[2], *pixels.shape[:2]))
    print(
        f"sample     id {row.get('id')}, label {label} ({class_name}), shape {shape}, "
        f"pixels min {pixels.min()} max {pixels.max()} mean {pixels.mean():.1f}"
    )
    for line in _thumbnail(pixels):
        print(f"           {line}")


def _thumbnail(pixels: np.ndarray) -> list[str]:
    gray = Image.fromarray(pixels[..., 0] if pixels.shape[-1] == 1 else pixels[..., :3]).convert("L")
    if gray.width > THUMBNAIL_MAX_WIDTH:
        gray = gray.resize((THUMBNAIL_MAX_WIDTH, max(1, round(gray.height * THUMBNAIL_MAX_WIDTH / gray.width))))
    levels = np.asarray(gray).astype(np.int64) * len(ASCII_RAMP) // 256
    return ["".join(ASCII_RAMP[level] * 2 for level in row) for row in levels]


def _shape_text(shape: Sequence[int] | None) -> str:
    return "x".join(str(d) for d in shape) if shape else "?"


def _numbers(values: Sequence[float] | None) -> str:
    return "[" + ", ".join(f"{v:.4f}" for v in values) + "]" if values else "unknown (no raytrain_ddp metadata)"


def _bytes_text(size: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if size < 1024:
            return f"{size:.0f} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"
