"""check_dataset: accepted inputs and one-line ConfigErrors for bad ones (no Ray)."""

from __future__ import annotations

import io
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from raytrain_ddp.data.format import read_info
from raytrain_ddp.data.prepare import from_arrays, write_tabular
from raytrain_ddp.data.validate import check_dataset
from raytrain_ddp.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[1]


def png(height: int, width: int, value: int = 0) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (value, value, value)).save(buffer, format="PNG")
    return buffer.getvalue()


def write_images(path: Path, labels: list, height: int = 8, width: int = 8, **options: object) -> Path:
    """A plain Parquet file (no raytrain_ddp metadata) with id, label, image columns."""
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table(
        {
            "id": pa.array(range(len(labels)), pa.int64()),
            "label": pa.array(labels),
            "image": pa.array([png(height, width, i) for i in range(len(labels))], pa.binary()),
        }
    )
    pq.write_table(table, path, **options)
    return path


def error_of(call: Callable[[], object]) -> str:
    with pytest.raises(ConfigError) as error:
        call()
    message = str(error.value)
    assert "\n" not in message
    return message


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (60, 3, 8, 8), dtype=np.uint8)
    labels = np.arange(60) % 3
    out = tmp_path / "ds"
    from_arrays(images, labels, ["a", "b", "c"], str(out), val_fraction=0.2, rows_per_file=12, row_group_size=4)
    return out


def test_dataset_directory(dataset: Path) -> None:
    info = check_dataset(str(dataset))
    expected = read_info(str(dataset))
    assert info.train_paths == expected.train_paths and len(info.train_paths) == 4
    assert info.val_paths == expected.val_paths
    assert info.rows == {"train": 48, "val": 12}
    assert (info.num_classes, info.classes, info.image_shape, info.encoding) == (3, ["a", "b", "c"], (3, 8, 8), "png")
    assert info.mean == expected.mean and info.std == expected.std


def test_split_directory_glob_list_file_and_uri(dataset: Path) -> None:
    train_paths = read_info(str(dataset)).train_paths
    by_directory = check_dataset(str(dataset / "train"), str(dataset / "val"), num_classes=3)
    assert by_directory.train_paths == train_paths and by_directory.rows == {"train": 48, "val": 12}
    assert by_directory.classes == ["a", "b", "c"]  # from the files' embedded metadata
    assert check_dataset(str(dataset / "train" / "part-*.parquet")).train_paths == train_paths
    assert check_dataset(train_paths[:2], train_paths[3]).val_paths == [train_paths[3]]
    assert check_dataset(train_paths[0]).rows == {"train": 12, "val": 0}
    assert check_dataset(f"file://{dataset}").train_paths == train_paths


def test_raw_and_tabular_datasets(tmp_path: Path) -> None:
    images = np.zeros((10, 4, 4), np.uint8)
    raw = from_arrays(images, np.arange(10) % 2, ["x", "y"], str(tmp_path / "raw"), encoding="raw")
    assert check_dataset(raw.path).image_shape == (1, 4, 4)

    tabular = write_tabular({"f": np.arange(20.0)}, np.arange(20) % 4, str(tmp_path / "tab"))
    info = check_dataset(tabular.path)
    assert (info.kind, info.feature_columns, info.num_classes) == ("tabular", ["f"], 4)
    message = error_of(lambda: check_dataset(tabular.path, feature_columns=["f", "g"]))
    assert message == f"no column 'g' in {tabular.train_paths[0]}; columns: id, label, f"


def test_chosen_features_get_their_own_statistics(tmp_path: Path) -> None:
    """--feature-columns may pick recorded features in another order: each keeps its own mean and std."""
    columns = {"a": np.arange(20.0), "b": np.full(20, 7.0), "c": np.arange(20.0) * 10}
    tabular = write_tabular(columns, np.arange(20) % 2, str(tmp_path / "tab"), val_fraction=0.0)
    everything = check_dataset(tabular.path)
    chosen = check_dataset(tabular.path, feature_columns=["c", "b"])
    assert chosen.mean == [everything.mean[2], everything.mean[1]] and chosen.std == [everything.std[2], 0.0]
    assert chosen.constant_inputs() == ["b"] and everything.constant_inputs() == ["b"]


def test_plain_parquet_without_metadata(tmp_path: Path) -> None:
    write_images(tmp_path / "train" / "a.parquet", [0, 4, 2])
    info = check_dataset(str(tmp_path / "train"))
    assert (info.num_classes, info.classes[-1], info.mean, info.encoding) == (5, "4", None, "png")


def test_missing_path_and_empty_directories(tmp_path: Path) -> None:
    assert (
        error_of(lambda: check_dataset(str(tmp_path / "nope"))) == f"dataset path does not exist: {tmp_path / 'nope'}"
    )
    (tmp_path / "empty").mkdir()
    assert (
        error_of(lambda: check_dataset(str(tmp_path / "empty")))
        == f"no .parquet files in {tmp_path / 'empty'} (it is empty)"
    )
    (tmp_path / "csvs").mkdir()
    (tmp_path / "csvs" / "data.csv").write_text("a,b\n")
    assert error_of(lambda: check_dataset(str(tmp_path / "csvs"))).endswith("(it holds data.csv)")
    assert (
        error_of(lambda: check_dataset(str(tmp_path / "x-*.parquet"))) == f"no files match {tmp_path / 'x-*.parquet'}"
    )
    assert error_of(lambda: check_dataset([])) == "an empty list of dataset paths was given"
    assert error_of(lambda: check_dataset("nosuchscheme://bucket/x")).startswith(
        "cannot open the filesystem for nosuchscheme://bucket/x:"
    )


def test_not_parquet_empty_and_truncated_files(dataset: Path, tmp_path: Path) -> None:
    text = tmp_path / "notes.parquet"
    text.write_text("hello, I am a CSV")
    assert error_of(lambda: check_dataset(str(text))) == f"{text} is not a Parquet file (it does not start with PAR1)"
    empty = tmp_path / "empty.parquet"
    empty.touch()
    assert error_of(lambda: check_dataset(str(empty))) == f"{empty} is an empty file, not Parquet"

    last = dataset / "train" / "part-00003.parquet"
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])
    message = error_of(lambda: check_dataset(str(dataset)))
    assert message.startswith(f"{last} is a truncated or corrupt Parquet file:")


def test_missing_columns_and_non_integer_labels(dataset: Path, tmp_path: Path) -> None:
    first = read_info(str(dataset)).train_paths[0]
    assert error_of(lambda: check_dataset(str(dataset), label_column="target")) == (
        f"no column 'target' in {first}; columns: id, label, image"
    )
    assert error_of(lambda: check_dataset(str(dataset), image_column="pixels")) == (
        f"no column 'pixels' in {first}; columns: id, label, image (for tabular data pass feature_columns)"
    )
    strings = write_images(tmp_path / "s.parquet", ["cat", "dog"])
    assert error_of(lambda: check_dataset(str(strings))) == (
        f"column 'label' in {strings} has type string; labels must be integers 0..num_classes-1"
    )


def test_labels_out_of_range(dataset: Path, tmp_path: Path) -> None:
    message = error_of(lambda: check_dataset(str(dataset), num_classes=2))
    assert message.startswith("labels in ") and message.endswith("go up to 2 but num_classes is 2 (allowed 0..1)")

    no_statistics = write_images(tmp_path / "nostats.parquet", [0, 1, 7], write_statistics=False)
    assert pq.ParquetFile(no_statistics).metadata.row_group(0).column(1).statistics is None
    assert error_of(lambda: check_dataset(str(no_statistics), num_classes=5)) == (
        f"labels in {no_statistics} go up to 7 but num_classes is 5 (allowed 0..4)"
    )
    negative = write_images(tmp_path / "neg.parquet", [0, -1])
    assert error_of(lambda: check_dataset(str(negative))) == f"labels in {negative} go down to -1 (allowed 0..0)"
    nulls = write_images(tmp_path / "null.parquet", pa.array([0, None], pa.int64()))
    assert error_of(lambda: check_dataset(str(nulls))) == (
        f"column 'label' in {nulls} has 1 null values; every row needs a label"
    )


def test_mixed_shapes_and_schemas(tmp_path: Path) -> None:
    small = write_images(tmp_path / "mixed" / "a.parquet", [0, 1], height=8, width=8)
    large = write_images(tmp_path / "mixed" / "b.parquet", [0, 1], height=10, width=8)
    assert error_of(lambda: check_dataset(str(tmp_path / "mixed"))) == (
        f"images differ in shape: the first image in {small} is 3x8x8, in {large} it is 3x10x8; "
        "training needs one fixed shape (re-convert with --image-size)"
    )
    other = tmp_path / "other.parquet"
    pq.write_table(pa.table({"id": [1], "label": pa.array([0], pa.int32()), "image": [png(8, 8)]}), other)
    assert error_of(lambda: check_dataset([str(small), str(other)])) == (
        f"{other} and {small} differ: column 'label' is int32 in the first, int64 in the second"
    )
    broken = tmp_path / "broken.parquet"
    pq.write_table(pa.table({"id": [1], "label": [0], "image": [b"not an image"]}), broken)
    assert error_of(lambda: check_dataset(str(broken))).startswith(
        f"cannot decode the first image in {broken} (column 'image'):"
    )


def test_incomplete_copy_is_detected(dataset: Path) -> None:
    (dataset / "train" / "part-00001.parquet").unlink()
    assert error_of(lambda: check_dataset(str(dataset))) == (
        f"{dataset}/train holds 36 rows but dataset.json says 48; files are missing or extra"
    )


def test_inspect_cli_reports_bad_input_in_one_line(tmp_path: Path) -> None:
    shutil.copy(__file__, tmp_path / "tests.parquet")
    done = subprocess.run(
        [sys.executable, "-m", "raytrain_ddp.data", "inspect", str(tmp_path / "tests.parquet")],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr == f"error: {tmp_path / 'tests.parquet'} is not a Parquet file (it does not start with PAR1)\n"
