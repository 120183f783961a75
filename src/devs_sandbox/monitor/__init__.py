"""Policies that watch live sandboxes: pure checks over samples, and the pollers that run them."""
