"""Conformance kit: base test classes that plugin test suites subclass.

Each submodule holds the kit for one component kind; a plugin's test module
subclasses the base class and supplies only its spec or factory. See
docs/plugins.md for examples.
"""
