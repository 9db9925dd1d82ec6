"""The heartbeat's words both sides share. No torch here: the driver's RunMonitor actor imports this."""

# What a rank does inside "checkpointing", in order: its heartbeat's phase progress is the index.
CHECKPOINT_STAGES = ("gathering", "saving", "reporting")
