"""Test machinery: the directory that :mod:`toolkit.testing` puts on the tests' ``PYTHONPATH`` (its
``sitecustomize``)."""
