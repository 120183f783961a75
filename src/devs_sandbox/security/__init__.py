"""Keeping host secrets out of sandboxes and getting session secrets in safely."""
