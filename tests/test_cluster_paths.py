"""The Slurm launcher's directories and token on shared nodes: real files, symlinks and owners in tmp dirs."""

from __future__ import annotations

import os
import stat

import pytest

from raytrain_ddp.cluster import paths
from raytrain_ddp.cluster.paths import UnsafePath
from raytrain_ddp.cluster.plan import JobPlan, Ports
from raytrain_ddp.cluster.slurm import prepare_job_dir


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_fresh_private_dir_is_0700_and_its_shared_base_is_left_as_it_is(tmp_path):
    base = tmp_path / "group"
    base.mkdir(mode=0o775)
    base.chmod(0o2775)  # a group's directory (setgid): the job must not take it over
    paths.private_dir(str(base / "rt7.0"))
    assert mode(base / "rt7.0") & 0o777 == 0o700 and mode(base) == 0o2775  # (setgid is inherited)
    paths.private_dir(str(tmp_path / "new" / "base" / "rt7.0"))  # a missing base is created, private
    assert mode(tmp_path / "new" / "base") == 0o700


def test_a_stale_dir_of_ours_is_replaced_by_an_empty_one(tmp_path):
    stale = tmp_path / "rt7.0"
    (stale / "r" / "sockets").mkdir(parents=True)
    stale.chmod(0o777)
    paths.private_dir(str(stale))
    assert list(stale.iterdir()) == [] and mode(stale) == 0o700


def test_a_symlink_is_refused_and_its_target_untouched(tmp_path):
    target = tmp_path / "elsewhere"
    (target / "keep").mkdir(parents=True)
    (tmp_path / "rt7.0").symlink_to(target)
    with pytest.raises(UnsafePath, match=r"rt7\.0 is a symlink \(to .*elsewhere\); refusing to follow it"):
        paths.private_dir(str(tmp_path / "rt7.0"))
    assert (target / "keep").is_dir() and mode(target) != 0o700
    paths.remove_own_dir(str(tmp_path / "rt7.0"))  # the cleanup's sweep leaves it too
    assert (target / "keep").is_dir()


def test_a_dir_someone_else_owns_or_a_file_is_refused(tmp_path):
    (tmp_path / "theirs").mkdir()
    why = paths.unsafe(str(tmp_path / "theirs"), uid=os.geteuid() + 1)  # as seen by another user's job
    assert why == (
        f"{tmp_path / 'theirs'} exists and belongs to uid {os.geteuid()}, not to this job's user "
        f"(uid {os.geteuid() + 1})"
    )
    (tmp_path / "file").write_text("x")
    with pytest.raises(UnsafePath, match="exists and is not a directory"):
        paths.private_dir(str(tmp_path / "file"))
    assert paths.unsafe(str(tmp_path / "missing")) is None


@pytest.mark.skipif(
    os.geteuid() != 0 and os.environ.get("CI") != "true",  # CI runs as root: there a non-root run fails
    reason="handing a directory to another user needs root",
)
def test_someone_elses_dir_is_refused_and_kept(tmp_path):
    theirs = tmp_path / "rt7.0"
    (theirs / "x").mkdir(parents=True)
    os.chown(theirs, 4242, 4242)
    with pytest.raises(UnsafePath, match="belongs to uid 4242"):
        paths.private_dir(str(theirs))
    paths.remove_own_dir(str(theirs))
    assert (theirs / "x").is_dir()


def test_the_token_is_created_exclusively_0600_never_through_a_symlink(tmp_path):
    token = tmp_path / "auth_token"
    paths.create_secret(str(token), "s3cret")
    assert token.read_text() == "s3cret" and mode(token) == 0o600
    with pytest.raises(UnsafePath, match="already exists"):
        paths.create_secret(str(token), "other")
    victim = tmp_path / "victim"
    victim.write_text("theirs")
    (tmp_path / "link").symlink_to(victim)
    with pytest.raises(UnsafePath):
        paths.create_secret(str(tmp_path / "link"), "s3cret")
    assert victim.read_text() == "theirs"


def test_the_job_dir_is_private_with_a_fresh_token_and_its_base_not_chmodded(tmp_path):
    base = tmp_path / "shared-base"
    base.mkdir()
    base.chmod(0o1777)  # RAYTRAIN_JOB_DIR_BASE on a scratch dir every user writes to
    job = base / "job-7"
    (job / "old").mkdir(parents=True)
    (job / "auth_token").write_text("the previous run's")
    prepare_job_dir(str(job), str(job / "auth_token"), "{}")
    assert mode(base) == 0o1777 and mode(job) == 0o700 and mode(job / "auth_token") == 0o600
    assert sorted(p.name for p in job.iterdir()) == ["auth_token", "plan.json"]
    assert len((job / "auth_token").read_text()) == 64
    job2 = base / "job-8"
    job2.symlink_to(tmp_path)
    with pytest.raises(UnsafePath, match="is a symlink"):
        prepare_job_dir(str(job2), str(job2 / "auth_token"), "{}")
    assert not (tmp_path / "auth_token").exists()


def test_rays_temp_dir_is_inside_the_nodes_private_dir():
    plan = JobPlan(7, 0, ["a"], [1], 0, False, 0, "h", Ports.block(1), Ports.block(1), "/t", "/j", "/py", False)
    assert plan.ray_tmp(0) == "/t/rt7.0/r" and os.path.dirname(plan.ray_tmp(0)) == plan.node_tmp(0)
