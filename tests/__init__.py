"""The test suite, a package: helpers and shared builders import by their path (`from tests.mcore.mcore_helpers import spawn`), in pytest and in the processes the tests spawn."""
