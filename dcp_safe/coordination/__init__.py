"""How the ranks of a job agree, gather, broadcast and wait for each other, each within a deadline.

One place per transport, and one translation of a missing or failed peer into a typed error
naming the rank (:class:`~dcp_safe.errors.CommitError`'s ``failures``):

- :mod:`.group`: the dedicated gloo groups and what a failed collective on them means;
- :mod:`.groups` and :mod:`.agreement`: the manager's groups, its exchange of votes, broadcast
  and rounds of waiting;
- :mod:`.store`: the default group's store (the coalesced saves' barrier, the verdicts);
- :mod:`.worker_group`: the checkpoint workers' own group, met in the job's rendezvous store;
- :mod:`.markers`: storage, polled (saves without collectives, commits seen from another rank).

No module outside this package creates a process group or a store client, or polls against a
deadline of its own (``tests/test_architecture.py``).
"""
