"""Benchmark suite (issue 7): `python -m bench [--quick | --smoke] [--json FILE]`.

Compares this project's Ray Train trainer with plain PyTorch DDP started by
torchrun, on the same model, data, optimizer and worker count, on this machine.
See bench/suite.py for what is measured and how.
"""
