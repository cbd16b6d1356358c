"""pytest plugin for toolkit and plugin authors (fixtures are being filled in)."""
