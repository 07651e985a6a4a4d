"""Drafting methods, one per file, behind ``base.Draft``."""
