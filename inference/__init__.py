"""Hearth's inference engine and node. Imports no Django."""
