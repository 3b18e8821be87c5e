"""The audited load: one plan, a sharded checkpoint read, per-parameter provenance."""
