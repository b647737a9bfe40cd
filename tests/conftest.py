"""Test-wide fixtures: the real SSH test host (sshd + bubblewrap containers) and the
real trainer's tiny CPU run (tests/tiny_run.py)."""

pytest_plugins = ["tests.host.fixtures", "tests.tiny_run"]
