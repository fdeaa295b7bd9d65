"""Publishing a checkpoint: the commit protocol (docs/architecture.md, "The commit protocol").

``strategy`` chooses how a backend publishes (an atomic rename of a work directory, or a marker
written last with an exclusive create) once, from its capabilities; ``committer`` is the
coordinator's verify-and-publish; ``lease`` guards a name while a save works on it; ``fencing``
refuses writers of an older job attempt.
"""
