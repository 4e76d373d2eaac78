"""Coursework: exercises beside the papers, each checked on its own (see exercises/README.md)."""
