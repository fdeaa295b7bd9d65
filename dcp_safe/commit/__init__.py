"""Publishing a checkpoint: docs/architecture.md, "The commit protocol"."""
