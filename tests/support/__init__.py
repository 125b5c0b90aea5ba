"""Helpers shared by the test suite (mount fixtures, tree comparison, conformance suites)."""
