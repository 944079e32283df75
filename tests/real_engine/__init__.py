"""Helpers that run real inference engines for the end-to-end tests."""
