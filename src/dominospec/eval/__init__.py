"""Evaluation: the offline comparison of decoding modes, the served evaluation, the headline."""
