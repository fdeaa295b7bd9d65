"""The committed view of a root: what is there, what is newest, whether it is intact.

``committed`` opens one committed checkpoint (marker and manifest checked); ``catalog`` lists
them, resolves ``"latest"`` and verifies (quick or every byte); ``watch`` waits for a commit;
``history`` owns the manager's ``_history.jsonl``; ``node_cache`` reads the node-local copies
left by node-local saves. Read-only, except the history append: writing checkpoints is
:mod:`dcp_safe.commit`'s job, removing them :mod:`dcp_safe.retention`'s.
"""
