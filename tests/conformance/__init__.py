"""Conformance suites: one body per interface, run by every implementation's tests."""
