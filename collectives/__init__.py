"""ringweave collectives (see collectives/api.py)."""
