"""What an S3 error from s3fs says: its error code and HTTP status.

s3fs maps the errors it knows to builtins (a missing key to ``FileNotFoundError``, a refused
conditional put to ``FileExistsError``) and wraps the rest in a plain ``OSError`` whose cause is
botocore's ``ClientError``; these helpers read the code and status from that cause, for the
cases the backend handles itself.
"""

from __future__ import annotations

__all__ = ["is_precondition_failed", "s3_error"]


def is_precondition_failed(exc: BaseException) -> bool:
    """A 412 that s3fs did not already map to FileExistsError (some S3-compatible servers
    leave out the ``Condition`` field s3fs keys on)."""
    code, status = s3_error(exc)
    return code in ("PreconditionFailed", "412") or status == 412


def s3_error(exc: BaseException) -> tuple[str, int | None]:
    """The S3 error code and HTTP status behind an s3fs ``OSError`` (``("", None)`` if none);
    a server may send either without the other, so a 416 is also reported as InvalidRange."""
    response = getattr(exc.__cause__, "response", None)
    if not isinstance(response, dict):
        return "", None
    code = str(response.get("Error", {}).get("Code", ""))
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    if code == "InvalidRange" or status == 416:
        return "InvalidRange", 416
    return code, status if isinstance(status, int) else None
