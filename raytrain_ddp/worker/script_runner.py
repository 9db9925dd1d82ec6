"""`python -m raytrain_ddp.worker.script_runner SCRIPT ARGS`: run SCRIPT as `python SCRIPT ARGS` runs it.

The launched worker (:mod:`.launched`) starts each rank's script through this: `runpy.run_path` runs it as
``__main__`` with ``sys.argv`` and ``sys.path[0]`` as Python itself sets them, and SIGINT (a Ctrl-C the driver
passes on) as a shell gives it. Added, unseen by the script: the process ends with its worker (a killed worker
leaves no orphan blocked in a collective), what it saved in ``session.checkpoint_dir()`` is uploaded when it
exits (with object storage), a call of ``torch.distributed.init_process_group`` is noted in the session folder,
so that a script that never joins the group is named instead of training alone on every rank, and so is a full
disk it died of, which ends the run as storage, not as a rank's failure.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.abc
import importlib.util
import os
import pickle
import runpy
import signal
import sys
from pathlib import Path
from types import TracebackType

from raytrain_ddp.session import CHECKPOINT_DIR_ENV, SESSION_ENV, upload_checkpoint

PARENT_PID_ENV = "RAYTRAIN_DDP_PARENT_PID"
PROCESS_GROUP_MARK = "process_group"  # in the session folder once the script called init_process_group
STORAGE_FULL_NOTE = "storage_full.pickle"  # in the session folder: the StorageFull the script died of
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def end_with_parent() -> None:
    """SIGKILL when the worker that started us dies (Ray ended it: a failed rank, Ctrl-C, the watchdog)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != int(os.environ.pop(PARENT_PID_ENV, os.getppid())):
        os._exit(1)  # it died before the line above


class _NoteProcessGroup(importlib.abc.MetaPathFinder):
    """Wraps torch.distributed.init_process_group as torch.distributed is first imported: the wrapper marks the
    session folder, then calls torch's. Importing torch ourselves first would change what the script sees (its
    own environment settings made before `import torch`)."""

    def __init__(self, mark: Path) -> None:
        self.mark = mark

    def find_spec(self, name, path, target=None):
        if name != "torch.distributed":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            exec_module = spec.loader.exec_module

            def exec_and_wrap(module) -> None:
                exec_module(module)
                module.init_process_group = self._noting(module.init_process_group)

            spec.loader.exec_module = exec_and_wrap  # type: ignore[method-assign]
        return spec

    def _noting(self, init_process_group):
        @functools.wraps(init_process_group)
        def noted(*args, **kwargs):
            self.mark.touch()
            return init_process_group(*args, **kwargs)

        return noted


def _take_ctrl_c() -> None:
    """SIGINT as `python SCRIPT` in a shell has it: Ray's processes block it (their children inherit the mask),
    and the driver passes a Ctrl-C on as SIGINT, which the script may catch as KeyboardInterrupt to save."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def main() -> None:
    end_with_parent()
    _take_ctrl_c()
    script, *args = sys.argv[1:]
    channel = os.environ.get(SESSION_ENV)
    if channel:
        sys.meta_path.insert(0, _NoteProcessGroup(Path(channel) / PROCESS_GROUP_MARK))
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT`: its folder, not ours
    try:
        try:
            runpy.run_path(script, run_name="__main__")
        finally:
            upload_checkpoint()  # however it ended, what it saved is in the store (with object storage)
    except Exception as error:  # shown as Python shows the script's own: its frames only, exit code 1
        trimmed = error.with_traceback(_from_script(error.__traceback__, os.path.abspath(script)))
        sys.excepthook(type(error), trimmed, trimmed.__traceback__)  # torch's hook reads the error's own
        _note_storage_full(error, channel)
        sys.exit(1)


def _note_storage_full(error: BaseException, channel: str | None) -> None:
    """A script that died of a full disk, a quota or a read-only mount (an OSError that says so, or its checkpoint
    folder's file system refusing a MiB now: torch.save loses the errno), or of a store that refused its checkpoint
    folder's upload (the session's StorageFull), leaves that StorageFull in its session folder: the run ends on it
    (exit 74) instead of restarting ranks that would fail the same way."""
    folder = os.environ.get(CHECKPOINT_DIR_ENV)
    if not channel or not folder:
        return
    from raytrain_ddp.errors import StorageFull, causes, full_storage_error, refused_now

    note = next((cause for cause in causes(error) if isinstance(cause, StorageFull)), None)
    if note is None and (full := full_storage_error(error) or refused_now(folder)) is not None:
        note = StorageFull.of(full, f"rank {os.environ.get('RANK', '0')}'s files", full.filename or folder)
    if note is not None:
        with contextlib.suppress(OSError):  # its own disk full too: an ordinary failure, then
            (Path(channel) / STORAGE_FULL_NOTE).write_bytes(pickle.dumps(note))


def _from_script(tb: TracebackType | None, script: str) -> TracebackType | None:
    """The traceback from the script's first frame on (runpy's and ours left out)."""
    first = tb
    while first is not None and first.tb_frame.f_code.co_filename != script:
        first = first.tb_next
    return first or tb


if __name__ == "__main__":
    main()
