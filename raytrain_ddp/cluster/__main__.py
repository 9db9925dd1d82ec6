"""`python -m raytrain_ddp.cluster COMMAND`.

status [--address HOST:PORT]   what the Ray cluster holds (raytrain_ddp.cluster.status)
slurm [trainer args]           the batch part of a Slurm job: Ray on every node, then the trainer
node JOB_DIR INDEX             one node's Ray, inside its srun step (started by `slurm`)
sweep JOB_ID TMP_BASE          stop the job's Ray processes on this node (started by `slurm`)
"""

import sys


def main(argv: list[str]) -> int:
    command, rest = (argv[0], argv[1:]) if argv else ("", [])
    if command == "slurm":
        from raytrain_ddp.cluster.slurm import main as slurm_main

        return slurm_main(rest)
    if command == "node":
        from raytrain_ddp.cluster.node import node_main

        return node_main(rest)
    if command == "sweep":
        from raytrain_ddp.cluster.node import sweep_main

        return sweep_main(rest)
    from raytrain_ddp.cluster.status import main as status_main

    return status_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
