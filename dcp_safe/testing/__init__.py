"""Test tools dcp_safe ships for its users' own tests and drills.

* :mod:`dcp_safe.testing.faulty_fs`: a fault-injecting fsspec file system (``faulty://``);
* :mod:`dcp_safe.testing.multiproc`: N spawned gloo ranks with a deadline and teardown;
* :mod:`dcp_safe.testing.s3`: a local moto S3 server; :mod:`dcp_safe.testing.s3_proxy`: an
  HTTP proxy that injects S3 faults;
* :mod:`dcp_safe.testing.backend_contract`: the contract every backend passes;
* :mod:`dcp_safe.testing.world`: N ranks' outputs of a save laid down without a process group.

Only the fault-injecting file system is imported here: the others pull in moto or
torch.distributed, which a user's drill may not need.
"""

from __future__ import annotations

from dcp_safe.testing.faulty_fs import FaultError, FaultInjector, FaultPlan, FaultyFileSystem

__all__ = ["FaultError", "FaultInjector", "FaultPlan", "FaultyFileSystem"]
