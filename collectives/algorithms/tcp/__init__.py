"""The algorithms that move their bytes as messages of the call (TCP, or memory between the ranks of
runtime.testing), one file each; they run on any group (collectives/algorithms/__init__.py)."""

__all__: list[str] = []  # reached through collectives.registry.ALGORITHMS
