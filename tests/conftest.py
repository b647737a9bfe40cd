"""Test-wide fixtures: the real SSH test host (sshd + bubblewrap containers)."""

pytest_plugins = ["tests.host.fixtures"]
