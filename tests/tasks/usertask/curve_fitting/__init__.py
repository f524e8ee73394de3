"""A user's own package, outside zerotrain: tests/tasks/test_user_task.py trains its task by ``module:Class``."""
