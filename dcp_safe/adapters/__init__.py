"""The DCP adapters: what ``torch.distributed.checkpoint`` calls (its ``StorageWriter`` and
``StorageReader``, the planners, and ``save``/``load`` with deadlines). Each module's job:
docs/architecture.md, "Layers".
"""
