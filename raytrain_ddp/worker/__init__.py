"""The worker side: what runs inside each Ray Train worker process."""
