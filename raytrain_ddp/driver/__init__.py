"""The driver side: CLI, preflight, Ray Train set-up, progress and the run report."""
