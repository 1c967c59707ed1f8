"""Measurements that prove the speed-ups: the naive baseline, the demo comparison, hardware provenance."""
