"""The run report and TensorBoard log, made from the session's real short run (conftest.shared_run).

The page is checked the way a person sees it: headless Chromium renders it,
dumps its DOM and takes a screenshot. Without Chromium that test is skipped,
except under CI=true, where it fails (CI installs Chromium).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
from support import run_cli

pytestmark = pytest.mark.ray

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CORE_PLOTS = {
    "loss.png",
    "val_accuracy.png",
    "throughput_per_rank.png",
    "data_wait_seconds_per_rank.png",
    "loss_per_step.png",  # the shared run records every 4th step
    "throughput_per_step.png",
}
SECTION_IDS = {"summary", "workers", "epochs", "config"}


@pytest.fixture(scope="module")
def report(trained_run) -> Path:
    from raytrain_ddp.report import write_report

    index = write_report(trained_run)
    assert index == trained_run / "report" / "index.html"
    return index


class PageParser(HTMLParser):
    """What the tests look for in a page: ids, plots, worker rows, text."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.plots: list[dict] = []
        self.worker_ranks: list[str] = []
        self.external: list[str] = []
        self.text: list[str] = []
        self._section: str | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "id" in a:
            self.ids.add(a["id"])
        if tag == "section":
            self._section = a.get("id")
        if tag == "img" and "plot" in (a.get("class") or "").split():
            self.plots.append(a)
        if tag == "tr" and self._section == "workers" and "data-rank" in a:
            self.worker_ranks.append(a["data-rank"])
        for key in ("src", "href"):
            if a.get(key) and not a[key].startswith(("data:", "#")):
                self.external.append(a[key])
        if tag in ("link", "script") and (a.get("src") or a.get("href")):
            self.external.append(a.get("src") or a.get("href"))

    def handle_data(self, data):
        self.text.append(data)


def parse(page: str) -> PageParser:
    parser = PageParser()
    parser.feed(page)
    return parser


def test_report_writes_valid_pngs(report):
    from PIL import Image

    files = {p.name for p in report.parent.glob("*.png")}
    assert CORE_PLOTS <= files, files
    for name in files:
        data = (report.parent / name).read_bytes()
        assert data.startswith(PNG_MAGIC), name
        with Image.open(report.parent / name) as image:
            image.verify()
            assert image.size[0] >= 400 and image.size[1] >= 200, (name, image.size)


def test_page_is_self_contained_and_complete(report, trained_run):
    page = report.read_text()
    doc = parse(page)
    assert SECTION_IDS <= doc.ids
    assert doc.external == [], "the page must not fetch anything"
    assert len(doc.plots) == len(list(report.parent.glob("*.png")))
    assert all(p["src"].startswith("data:image/png;base64,") and p.get("alt") for p in doc.plots)
    assert doc.worker_ranks == ["0", "1"]
    text = " ".join(" ".join(doc.text).split())
    summary = json.loads((trained_run / "summary.json").read_text())
    assert "global batch = per-worker batch x workers" in text
    assert "2 of 2 completed" in text and "finished" in text
    assert summary["best_checkpoint"] in text
    assert summary["workers"][0]["hostname"] in text and summary["param_checksums"][0] in text
    assert "train_size" in text and "4096" in text  # the configuration table
    workers = page[page.index('id="workers"') : page.index('id="epochs"')]
    assert "<th>micro-batches</th>" in workers and "<th>steps</th>" not in workers  # counted by their own name


def test_profile_section_lists_each_ranks_top_operators(report, trained_run):
    """The shared run profiles steps 3:4: the page shows each rank's table, read from profile/rank-N.top_ops.json."""
    page = report.read_text()
    assert 'id="profile"' in page
    section = page[page.index('id="profile"') : page.index('id="epochs"')]
    for rank in (0, 1):
        table = json.loads((trained_run / "profile" / f"rank-{rank}.top_ops.json").read_text())
        block = section[section.index(f'data-rank="{rank}"') :]
        assert "optimizer steps 3\u20134" in block[:300]
        top = table["ops"][0]
        assert top["name"] in block and f"{top['self_cpu_us'] / 1000:,.2f}" in block
    assert str(trained_run / "profile") in section and "self GPU" not in section  # a CPU run


def test_cli_prints_index_path(trained_run):
    result = run_cli("raytrain_ddp.report", str(trained_run), timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(trained_run / "report" / "index.html")
    assert result.stderr == ""


@pytest.mark.parametrize("make", ["missing", "empty"])
def test_cli_bad_run_dir_is_one_line_exit_2(tmp_path, make):
    run_dir = tmp_path / "nope"
    if make == "empty":
        run_dir.mkdir()
    result = run_cli("raytrain_ddp.report", str(run_dir), timeout=120)
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(run_dir) in lines[0], result.stderr


def test_failed_run_with_no_epochs_gets_a_report(tmp_path, trained_run):
    from raytrain_ddp.report import write_report

    run_dir = tmp_path / "crashed"
    run_dir.mkdir()
    shutil.copy(trained_run / "config.toml", run_dir)
    (run_dir / "summary.json").write_text(
        json.dumps(
            {
                "status": "failed",
                "error": "rank 1: RuntimeError: boom <b>not markup</b>",
                "name": "crashed",
                "run_dir": str(run_dir),
                "epochs_completed": 0,
                "epochs_requested": 2,
                "world_size": 2,
                "per_worker_batch_size": 64,
                "global_batch_size": 128,
                "workers": [],
                "restarts": 2,
                "final_metrics": None,
                "best_checkpoint": None,
                "best_metrics": None,
                "samples_per_second": None,
                "param_checksums": [None, None],
                "replicas_identical": False,
                "seconds": 3.2,
            }
        )
    )
    page = write_report(run_dir).read_text()
    doc = parse(page)
    text = " ".join(" ".join(doc.text).split())
    assert SECTION_IDS <= doc.ids and doc.plots == [] and "profile" not in doc.ids  # no --profile-steps
    assert "failed" in text and "RuntimeError: boom <b>not markup</b>" in text  # escaped, shown as text
    assert "failed before finishing any epoch" in text
    assert list(run_dir.joinpath("report").glob("*.png")) == []


def test_new_per_rank_fields_show_and_missing_ones_are_left_out(tmp_path, trained_run):
    """Fields the trainer may add later get plots/columns; a field it drops loses its plot, no crash."""
    from raytrain_ddp.report import write_report

    run_dir = tmp_path / "changed"
    run_dir.mkdir()
    for name in ("config.toml", "summary.json"):
        shutil.copy(trained_run / name, run_dir)
    records = [json.loads(line) for line in (trained_run / "metrics.jsonl").read_text().splitlines()]
    with open(run_dir / "metrics.jsonl", "w") as f:
        for rec in records:
            rec.pop("data_wait_seconds_per_rank")
            rec.update(
                micro_batch_seconds_per_rank=[0.01, 0.012],
                gpu_memory_peak_gib_per_rank=[1.5, 1.25],
                mystery_per_rank=[7, 8],
                not_a_list_per_rank="x",
            )
            f.write(json.dumps(rec) + "\n")
        f.write('{"epoch": 3, "train_lo')  # a line cut short by a crash
    index = write_report(run_dir)
    files = {p.name for p in index.parent.glob("*.png")}
    assert {"micro_batch_seconds_per_rank.png", "gpu_memory_peak_gib_per_rank.png"} <= files
    assert "data_wait_seconds_per_rank.png" not in files
    page = index.read_text()
    workers = page[page.index('id="workers"') : page.index('id="epochs"')]
    assert "GPU mem peak (GiB)" in workers and "mystery" in workers and "data wait" not in workers
    text = " ".join(parse(page).text)
    assert "line 3 is not JSON" in text


def test_tensorboard_log_round_trip(tmp_path, trained_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from raytrain_ddp.driver.tensorboard_log import TensorBoardLog

    records = [json.loads(line) for line in (trained_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [1, 2]
    tb = TensorBoardLog(tmp_path)
    for rec in records:
        tb.write_epoch(rec)
    tb.write_epoch({"epoch": 3, "train_loss": None, "samples_per_rank": "?"})  # junk is skipped, not fatal
    steps = [json.loads(line) for line in (trained_run / "steps.jsonl").read_text().splitlines()]
    for rec in steps:
        tb.write_step(rec)
    tb.close()

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    expected = {
        "train/loss",
        "train/loss_min",
        "train/loss_max",
        "val/loss",
        "val/accuracy",
        "throughput/samples_per_second",
        "throughput/rank_0",
        "throughput/rank_1",
        "data_wait/rank_0",
        "data_wait/rank_1",
    }
    assert expected <= tags, expected - tags

    def series(tag):
        return [(e.step, e.value) for e in events.Scalars(tag)]

    for tag, key in [
        ("train/loss", "train_loss"),
        ("val/accuracy", "val_accuracy"),
        ("throughput/samples_per_second", "samples_per_second"),
    ]:
        assert series(tag) == [(r["epoch"], pytest.approx(r[key], rel=1e-6)) for r in records], tag
    assert series("throughput/rank_1") == [
        (r["epoch"], pytest.approx(r["samples_per_rank"][1] / r["seconds"], rel=1e-6)) for r in records
    ]
    assert series("data_wait/rank_0") == [
        (r["epoch"], pytest.approx(r["data_wait_seconds_per_rank"][0], rel=1e-6)) for r in records
    ]
    for tag, key in [
        ("step/train_loss", "train_loss"),
        ("step/lr", "lr"),
        ("step/samples_per_second", "samples_per_second"),
    ]:
        assert series(tag) == [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in steps], tag


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    if os.environ.get("CI") == "true":
        pytest.fail("chromium is not installed, and CI=true requires it (apt-get install -y chromium)")
    pytest.skip("chromium is not installed (apt-get install -y chromium); the rendered-page test needs it")


def _headless(chromium: str, profile: Path, *args: str) -> subprocess.CompletedProcess:
    command = [
        chromium,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        *args,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def test_page_renders_in_headless_chromium(report, tmp_path):
    from PIL import Image, ImageStat

    chromium = _chromium()
    url = report.resolve().as_uri()

    dom = _headless(chromium, tmp_path / "profile", "--dump-dom", url)
    assert dom.returncode == 0, dom.stderr[-2000:]
    doc = parse(dom.stdout)
    assert SECTION_IDS <= doc.ids
    assert len(doc.plots) >= len(CORE_PLOTS)
    assert all(p["src"].startswith("data:image/png;base64,") for p in doc.plots)
    assert doc.worker_ranks == ["0", "1"]

    shot = tmp_path / "screenshot.png"
    taken = _headless(chromium, tmp_path / "profile", f"--screenshot={shot}", "--window-size=1280,2400", url)
    assert taken.returncode == 0 and shot.exists(), taken.stderr[-2000:]
    assert shot.stat().st_size > 20_000
    with Image.open(shot) as image:
        assert image.size == (1280, 2400)
        rgb = image.convert("RGB")
        assert len(rgb.getcolors(maxcolors=1 << 20) or range(1 << 20)) > 50  # many colours: text and plots
        assert max(ImageStat.Stat(rgb).stddev) > 10  # not one flat colour


def test_a_large_worlds_report_shows_each_figures_spread_and_its_extreme_ranks(tmp_path):
    """Above epochs.PER_RANK_LIMIT ranks the records hold summaries: the page shows them, no per-rank lists."""
    from support import rank_epoch_message

    from raytrain_ddp import TrainConfig
    from raytrain_ddp.driver.epochs import PER_RANK_LIMIT
    from raytrain_ddp.driver.monitor import RunRecorder
    from raytrain_ddp.report import write_report

    world = PER_RANK_LIMIT + 1
    config = TrainConfig(num_workers=world, log_every_steps=0, storage_path=str(tmp_path), name="large")
    config.run_dir.mkdir(parents=True)
    recorder = RunRecorder(config.run_dir, config, train_rows=512 * world, world_size=world, sinks=[])
    recorder.consume([("epoch", rank, rank_epoch_message(rank)) for rank in range(world)])
    (config.run_dir / "summary.json").write_text(json.dumps({"status": "finished", "world_size": world}))
    page = write_report(config.run_dir).read_text()
    doc = parse(page)
    assert "rank-summaries" in doc.ids
    section = page[page.index('id="rank-summaries"') : page.index('id="workers"')]
    assert "train loss" in section and f"{world - 1}, {world - 2}, {world - 3}" in section  # loss 1 + rank
    assert "ranks/epoch-1.json" in section
