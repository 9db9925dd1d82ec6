"""A script that never calls init_process_group: every rank would train alone."""

import os

print(f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} trains alone", flush=True)
