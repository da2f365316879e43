"""A module that fails to import, for the error message of a callback path."""

raise RuntimeError("broken on purpose")
