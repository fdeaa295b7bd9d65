"""The committed view of a root: what is there, what is newest, whether it is intact.

Read-only, except the history append: writing checkpoints is :mod:`dcp_safe.commit`'s job,
removing them :mod:`dcp_safe.retention`'s.
"""
