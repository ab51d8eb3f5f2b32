"""ringweave's tools, each a command (``python -m tools.<name> --help``): status (what every rank
of a running job is doing), locate (where a job's store is), trace (merging the ranks' traces),
exitloop (running a script many times and counting failures), sz (lines and tokens per file).
"""

__all__ = ["status", "locate", "trace", "exitloop", "sz"]
