"""Checkpoints: what one holds, how it is written and read, verified, chosen to resume from, and its commands.

On the workers (inside Ray Train's worker loop):

* ``saver.py``: writing a checkpoint in either format behind one interface (``Saver``: ``FullSaver``,
  ``ShardedSaver``) and reporting it to Ray Train; loading the one Ray Train hands a worker that resumes. Its
  docstring describes the two formats.

On the driver (before any worker starts, and when the run ends):

* ``registry.py``: which checkpoint a run starts from: Ray Train's snapshot of the run's checkpoints,
  corrupt and unrecorded ones set aside, ``--resume-from``.
* ``verify.py``: whether a checkpoint can be used (also read by the one-process commands).
* ``ranking.py``: how checkpoints rank (Ray Train's retention, the summary's best); the workers read it too, for
  the score a mid-epoch checkpoint records.

On one process, without Ray (``python -m raytrain_ddp.checkpoint``, ``raytrain-ddp checkpoint``, evaluate):

* ``cli.py``: the ``checkpoint`` commands; ``consolidate.py``: a sharded checkpoint as one file, or its
  model weights in a plain model.

Everywhere: ``layout.py`` (file names, which format, reading and writing one file) and ``state.py`` (what a
checkpoint holds, key by key, as one dataclass from which the keys a resume needs are derived; where training
stands; how messages name them).

Nothing is imported here: a worker of a DDP run imports only what it uses (torch.distributed.checkpoint only
for sharded checkpoints, on first use).
"""
