"""Converters, the format contract and the CLI (no Ray)."""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from raytrain_ddp.data.format import METADATA_KEY, decode_images, read_info, write_split
from raytrain_ddp.data.prepare import (
    from_arrays,
    from_cifar10,
    from_csv,
    from_imagefolder,
    split_by_class,
    write_tabular,
)
from raytrain_ddp.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[1]
CLASSES = ["circle", "square", "stripes"]
IMAGES_PER_CLASS = 20


def class_pattern(label: int, rng: np.random.Generator, size: int = 8) -> np.ndarray:
    """An 8x8 RGB image whose bright pixels depend on the class, plus noise."""
    y, x = np.mgrid[:size, :size]
    masks = [
        (y - size / 2 + 0.5) ** 2 + (x - size / 2 + 0.5) ** 2 < (size / 3) ** 2,
        (abs(y - size / 2 + 0.5) < size / 4) & (abs(x - size / 2 + 0.5) < size / 4),
        y % 2 == 0,
    ]
    image = np.where(masks[label][..., None], 200, 40) + rng.integers(0, 40, (size, size, 3))
    return image.astype(np.uint8)


def read_rows(paths: list[str]) -> dict[int, dict]:
    table = pa.concat_tables(pq.read_table(path) for path in paths)
    return {row["id"]: row for row in table.to_pylist()}


def encode_png(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def decode(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)))


@pytest.fixture
def image_folder(tmp_path: Path) -> tuple[Path, list[np.ndarray]]:
    """ROOT/CLASS/NN.png, and the original pixels in sorted (class, file) order."""
    root = tmp_path / "images"
    rng = np.random.default_rng(0)
    originals = []
    for label, name in enumerate(CLASSES):
        (root / name).mkdir(parents=True)
        for index in range(IMAGES_PER_CLASS):
            pixels = class_pattern(label, rng)
            Image.fromarray(pixels).save(root / name / f"{index:02d}.png")
            originals.append(pixels)
    (root / "circle" / "notes.txt").write_text("not an image; skipped")
    return root, originals


def test_imagefolder_round_trip(image_folder: tuple[Path, list[np.ndarray]], tmp_path: Path) -> None:
    root, originals = image_folder
    out = tmp_path / "ds"
    info = from_imagefolder(str(root), str(out), val_fraction=0.25, seed=0, rows_per_file=16, row_group_size=5)

    assert info == read_info(str(out))
    assert info.classes == CLASSES and info.num_classes == 3
    assert info.kind == "image" and info.encoding == "png" and info.image_shape == (3, 8, 8)
    assert info.rows == {"train": 45, "val": 15}
    assert [os.path.basename(p) for p in info.train_paths] == [f"part-0000{i}.parquet" for i in range(3)]

    train, val = read_rows(info.train_paths), read_rows(info.val_paths)
    assert len(train) == 45 and len(val) == 15
    assert sorted([*train, *val]) == list(range(60))  # ids unique across splits
    for image_id, row in {**train, **val}.items():
        assert row["label"] == image_id // IMAGES_PER_CLASS
        np.testing.assert_array_equal(decode(row["image"]), originals[image_id])
    # Already-PNG sources are stored byte for byte.
    assert train[0]["image"] == (root / "circle" / "00.png").read_bytes()

    train_pixels = np.stack([originals[i] for i in train]).reshape(-1, 3) / 255
    np.testing.assert_allclose(info.mean, train_pixels.mean(axis=0), rtol=1e-9)
    np.testing.assert_allclose(info.std, train_pixels.std(axis=0), rtol=1e-9)

    stored = json.loads((out / "dataset.json").read_text())
    assert stored["format_version"] == 1 and stored["rows"] == {"train": 45, "val": 15}
    for path in info.train_paths + info.val_paths:
        parquet = pq.ParquetFile(path)
        assert json.loads(parquet.schema_arrow.metadata[METADATA_KEY]) == stored
        assert all(parquet.metadata.row_group(i).num_rows <= 5 for i in range(parquet.num_row_groups))
        assert parquet.schema_arrow.names == ["id", "label", "image"]


def test_split_is_deterministic_per_seed(image_folder: tuple[Path, list[np.ndarray]], tmp_path: Path) -> None:
    root, _ = image_folder
    val_ids = {}
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        info = from_imagefolder(str(root), str(tmp_path / name), val_fraction=0.25, seed=seed)
        val_ids[name] = sorted(read_rows(info.val_paths))
    assert val_ids["a"] == val_ids["b"] != val_ids["c"]
    labels = [image_id // IMAGES_PER_CLASS for image_id in val_ids["c"]]
    assert [labels.count(label) for label in range(3)] == [5, 5, 5]


def test_write_split_bounds_row_groups_and_files_by_rows_and_bytes(tmp_path: Path) -> None:
    schema = pa.schema([("id", pa.int64()), ("blob", pa.binary())])
    batches = (
        pa.record_batch([pa.array(range(start, start + 50), pa.int64()), pa.array([b"x" * 1000] * 50)], schema=schema)
        for start in range(0, 200, 50)
    )
    paths = write_split(
        str(tmp_path / "split"),
        batches,
        schema,
        rows_per_file=60,
        row_group_size=30,
        row_group_bytes=10_000,
        file_bytes=40_000,
    )
    # ~1012 bytes a row: 10-row groups by bytes; files close at the group reaching 40 kB.
    groups = [
        [pq.ParquetFile(p).metadata.row_group(i).num_rows for i in range(pq.ParquetFile(p).num_row_groups)]
        for p in paths
    ]
    assert groups == [[10, 10, 10, 10]] * 5
    assert pa.concat_tables(pq.read_table(p) for p in paths).column("id").to_pylist() == list(range(200))
    assert write_split(str(tmp_path / "empty"), [], schema) == [] and (tmp_path / "empty").is_dir()


def test_split_by_class_keeps_a_train_row_per_class() -> None:
    labels = np.array([0, 0, 1, 2, 2, 2])
    train, val = split_by_class(labels, val_fraction=0.9, seed=3)
    assert sorted(np.concatenate([train, val]).tolist()) == list(range(6))
    assert set(labels[train]) == {0, 1, 2}
    with pytest.raises(ConfigError, match=r"val fraction must be in \[0, 1\), got 1.5"):
        split_by_class(np.array([0, 1]), 1.5, 0)


def test_image_size_resizes_and_mixed_sizes_need_it(tmp_path: Path) -> None:
    root = tmp_path / "images"
    for name, size in (("cats", (12, 10)), ("dogs", (16, 16))):
        (root / name).mkdir(parents=True)
        for index in range(3):
            Image.new("RGB", size, (index * 50, 80, 120)).save(root / name / f"{index}.jpg")
    with pytest.raises(ConfigError, match=r"images differ in size .* pass --image-size"):
        from_imagefolder(str(root), str(tmp_path / "ds"))
    assert not (tmp_path / "ds").exists()

    info = from_imagefolder(str(root), str(tmp_path / "ds"), val_fraction=0.34, image_size=4)
    assert info.image_shape == (3, 4, 4) and info.encoding == "png"
    for row in read_rows(info.train_paths + info.val_paths).values():
        assert decode(row["image"]).shape == (4, 4, 3)


def test_all_jpeg_sources_stay_jpeg_and_grayscale_has_one_channel(tmp_path: Path) -> None:
    root = tmp_path / "images"
    for name in ("dark", "light"):
        (root / name).mkdir(parents=True)
        for index in range(4):
            Image.new("L", (6, 6), 30 + index).save(root / name / f"{index}.jpeg")
    info = from_imagefolder(str(root), str(tmp_path / "ds"), val_fraction=0.25)
    assert info.encoding == "jpeg" and info.image_shape == (1, 6, 6)
    row = read_rows(info.train_paths)[0]
    assert row["image"] == (root / "dark" / "0.jpeg").read_bytes()


def test_refuses_to_overwrite(image_folder: tuple[Path, list[np.ndarray]], tmp_path: Path) -> None:
    root, _ = image_folder
    out = tmp_path / "ds"
    from_imagefolder(str(root), str(out), val_fraction=0.25, seed=0)
    with pytest.raises(ConfigError) as error:
        from_imagefolder(str(root), str(out), val_fraction=0.25, seed=1)
    assert str(error.value) == f"output directory {out} is not empty; pass --overwrite to replace it"

    info = from_imagefolder(str(root), str(out), val_fraction=0.5, seed=1, overwrite=True)
    assert read_info(str(out)).rows == info.rows == {"train": 30, "val": 30}

    precious = tmp_path / "home"
    precious.mkdir()
    (precious / "thesis.tex").write_text("keep me")
    with pytest.raises(ConfigError, match=r"refusing to overwrite .* holds no dataset\.json"):
        from_imagefolder(str(root), str(precious), overwrite=True)
    assert (precious / "thesis.tex").read_text() == "keep me"


def test_failed_conversion_leaves_nothing_behind(image_folder: tuple[Path, list[np.ndarray]], tmp_path: Path) -> None:
    root, _ = image_folder
    (root / "square" / "99.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    with pytest.raises(ConfigError, match=r"cannot read image .*99\.png"):
        from_imagefolder(str(root), str(tmp_path / "ds"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["images"]


def write_fake_cifar10(directory: Path, per_batch: int = 4) -> np.ndarray:
    """The cifar-10-batches-py layout with tiny batches; returns all images N,3,32,32."""
    directory.mkdir()
    rng = np.random.default_rng(1)
    batches = []
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8)
        labels = [int(x) for x in rng.integers(0, 10, per_batch)]
        with open(directory / name, "wb") as file:
            pickle.dump({b"batch_label": name.encode(), b"labels": labels, b"data": data, b"filenames": []}, file)
        batches.append(data)
    names = [b"airplane", b"automobile", b"bird", b"cat", b"deer", b"dog", b"frog", b"horse", b"ship", b"truck"]
    with open(directory / "batches.meta", "wb") as file:
        pickle.dump({b"label_names": names, b"num_cases_per_batch": per_batch, b"num_vis": 3072}, file)
    return np.concatenate(batches).reshape(-1, 3, 32, 32)


def test_cifar10(tmp_path: Path) -> None:
    images = write_fake_cifar10(tmp_path / "cifar-10-batches-py")
    info = from_cifar10(str(tmp_path / "cifar-10-batches-py"), str(tmp_path / "ds"))
    assert info.classes[:2] == ["airplane", "automobile"] and info.num_classes == 10
    assert info.rows == {"train": 20, "val": 4} and info.image_shape == (3, 32, 32)
    rows = read_rows(info.train_paths + info.val_paths)
    assert sorted(rows) == list(range(24)) and set(read_rows(info.val_paths)) == set(range(20, 24))
    for image_id, row in rows.items():
        np.testing.assert_array_equal(decode(row["image"]), images[image_id].transpose(1, 2, 0))

    with pytest.raises(ConfigError, match="is not a CIFAR-10 python directory: missing data_batch_1"):
        from_cifar10(str(tmp_path), str(tmp_path / "other"))


def test_from_arrays_raw_encoding(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    images = rng.integers(0, 256, (30, 5, 6, 3), dtype=np.uint8)  # N,H,W,C
    labels = np.arange(30) % 3
    info = from_arrays(images, labels, ["a", "b", "c"], str(tmp_path / "ds"), encoding="raw", val_fraction=0.2)
    assert info.encoding == "raw" and info.image_shape == (3, 5, 6) and info.rows == {"train": 24, "val": 6}
    assert pq.read_schema(info.train_paths[0]).field("image").type == pa.list_(pa.uint8(), 90)
    for image_id, row in read_rows(info.train_paths + info.val_paths).items():
        stored = np.array(row["image"], np.uint8).reshape(info.image_shape)
        np.testing.assert_array_equal(stored, images[image_id].transpose(2, 0, 1))
    with pytest.raises(ConfigError, match=r"labels range 0..2 but there are 2 classes \(allowed 0..1\)"):
        from_arrays(images, labels, ["a", "b"], str(tmp_path / "bad"))


def test_decode_images_takes_ray_numpy_batches() -> None:
    images = np.random.default_rng(3).integers(0, 256, (4, 3, 5, 6), dtype=np.uint8)  # N,C,H,W
    as_png = np.array([encode_png(image.transpose(1, 2, 0)) for image in images], dtype=object)
    np.testing.assert_array_equal(decode_images(as_png, "png", (3, 5, 6)), images)
    flat = images.reshape(4, -1)
    np.testing.assert_array_equal(decode_images(flat, "raw", (3, 5, 6)), images)
    rows_as_objects = np.empty(4, dtype=object)  # how Ray may hand over a list column
    for index, row in enumerate(flat):
        rows_as_objects[index] = row
    np.testing.assert_array_equal(decode_images(rows_as_objects, "raw", (3, 5, 6)), images)
    gray = decode_images(as_png[:1], "png", (1, 5, 6))  # converted to the dataset's channel count
    assert gray.shape == (1, 1, 5, 6)
    with pytest.raises(ValueError, match=r"image 0 of the batch is \(3, 5, 6\), expected \(3, 6, 5\)"):
        decode_images(as_png, "png", (3, 6, 5))


def test_write_tabular_and_csv(tmp_path: Path) -> None:
    features = {"x": np.linspace(0, 1, 40), "y": np.arange(40, dtype=np.int32)}
    info = write_tabular(features, np.arange(40) % 2, str(tmp_path / "tab"), val_fraction=0.25)
    assert info.kind == "tabular" and info.feature_columns == ["x", "y"] and info.classes == ["0", "1"]
    assert info.image_shape is None and info.rows == {"train": 30, "val": 10}
    train = read_rows(info.train_paths)
    np.testing.assert_allclose(info.mean[1], np.mean([row["y"] for row in train.values()]))

    csv = tmp_path / "iris.csv"
    csv.write_text("petal,sepal,species\n1.0,2,setosa\n1.5,3,virginica\n0.9,2,setosa\n1.6,4,virginica\n")
    info = from_csv(str(csv), str(tmp_path / "iris"), "species", val_fraction=0.5)
    assert info.classes == ["setosa", "virginica"] and info.feature_columns == ["petal", "sepal"]
    assert info.rows == {"train": 2, "val": 2}
    with pytest.raises(ConfigError, match=r"no column 'kind' in .*iris\.csv; columns: petal, sepal, species"):
        from_csv(str(csv), str(tmp_path / "other"), "kind")


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "raytrain_ddp.data", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )


def test_cli_prepare_and_inspect(image_folder: tuple[Path, list[np.ndarray]], tmp_path: Path) -> None:
    root, _ = image_folder
    out = tmp_path / "ds"
    done = run_cli("prepare", "--from", "imagefolder", str(root), "--out", str(out), "--val-fraction", "0.25")
    assert done.returncode == 0, done.stderr
    assert read_info(str(out)).rows == {"train": 45, "val": 15}

    shown = run_cli("inspect", str(out))
    assert shown.returncode == 0, shown.stderr
    for expected in (
        "classes    3: circle, square, stripes",
        "3x8x8 (CxHxW), png",
        "id: int64, label: int64, image: binary",
    ):
        assert expected in shown.stdout
    assert re.search(
        r"sample     id \d+, label \d \((circle|square|stripes)\), shape 3x8x8", shown.stdout
    )  # train is stored shuffled
    assert "train" in shown.stdout and " 45 " in shown.stdout

    again = run_cli("prepare", "--from", "imagefolder", str(root), "--out", str(out))
    assert again.returncode == 2
    assert again.stderr == f"error: output directory {out} is not empty; pass --overwrite to replace it\n"

    wrong_flag = run_cli("prepare", "--from", "cifar10", str(root), "--out", str(tmp_path / "c"), "--image-size", "8")
    assert (wrong_flag.returncode, wrong_flag.stderr) == (2, "error: --image-size applies only to --from imagefolder\n")
    assert run_cli("prepare", "--from", "tiff", str(root)).returncode == 2  # argparse error
