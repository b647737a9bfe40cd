"""A real test host: OpenSSH sshd on loopback, with `pct` and `pvesh` stand-ins whose
containers are bubblewrap sandboxes (own PID, UTS and mount namespaces)."""
