"""Ray clusters for training runs: `status` (what a cluster holds) and the Slurm launcher.

`python -m raytrain_ddp.cluster status|slurm|node|sweep ...`; see __main__.py.
"""
