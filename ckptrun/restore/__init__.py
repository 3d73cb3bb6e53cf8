"""Rebuilding a step from a directory: recovery plans, exact replay of differential records, export."""
