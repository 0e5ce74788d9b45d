"""Helpers of the test suite that are not fixtures: imported by tests, by the
child processes they start, and by benches (each puts `tests/` on `sys.path`,
as pytest does for the tests)."""
