"""Engines: the jitted interpreters of encoded plans."""
