"""Stand-in trainer for cluster tests that need only a Ray cluster.

Accepts the trainer's command line (unknown flags are ignored), joins the
cluster, runs one task pinned to each node, and writes
STORAGE/NAME/probe.json with what each node reported. Used via
RAYTRAIN_MODULE=ray_probe (with tests/slurm on PYTHONPATH) where a full
training run would only cost time.
"""

import argparse
import json
import os
import signal
import socket
import sys
import time


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--address", required=True)
    p.add_argument("--num-workers", type=int, default=1)
    p.add_argument("--storage-path", required=True)
    p.add_argument("--name", required=True)
    p.add_argument(
        "--hold-seconds", type=float, default=0, help="stay connected this long (for signal tests); USR1 is recorded"
    )
    args, _ = p.parse_known_args()
    run_dir = os.path.join(args.storage_path, args.name)
    os.makedirs(run_dir, exist_ok=True)

    def on_usr1(signum, frame):
        open(os.path.join(run_dir, "got_usr1"), "w").close()
        print("probe: got USR1", flush=True)

    signal.signal(signal.SIGUSR1, on_usr1)

    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ray.init(address=args.address, log_to_driver=False)
    nodes = [n for n in ray.nodes() if n["Alive"]]

    @ray.remote(num_cpus=0)
    def where():
        return {"hostname": socket.gethostname(), "node_ip": ray.util.get_node_ip_address()}

    seen = ray.get(
        [
            where.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote()
            for n in nodes
        ]
    )
    out = {
        "address": args.address,
        "nodes": [{"hostname": n["NodeManagerHostname"], "node_ip": n["NodeManagerAddress"]} for n in nodes],
        "tasks": seen,
        "cluster_resources": ray.cluster_resources(),
    }
    with open(os.path.join(run_dir, "probe.json"), "w") as f:
        json.dump(out, f, indent=1)
    print("probe:", json.dumps(out), flush=True)
    if args.hold_seconds:
        print("probe: holding", flush=True)
        deadline = time.time() + args.hold_seconds
        while time.time() < deadline:
            time.sleep(0.2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
