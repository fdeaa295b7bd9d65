"""Background replication of committed checkpoints to a second root: docs/architecture.md,
"Replication and the remote tier"."""
