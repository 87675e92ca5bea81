"""Test support: databases cloned from a migrated template, factories, gates."""
