"""A user's own package, outside zerotrain: tests/test_user_task.py trains its task by ``module:Class``."""
