"""The remote half of deploy, restart, stop, runs and logs: a stdlib-only package.

It runs where the trainer runs (inside the container, or on the host when there is no
container), so nothing has to be installed there: dflashctl/remote/agent_client.py bundles
these modules into one program, pipes it to `<container.python> -S -`, and the
program keeps a copy under its content hash, so later calls send only a small
bootstrap (see remote/agent_client.py).

Modules: errors, files (reading, atomic writing, the workdir lock), manifest (shared
with dflashctl/ops/sync.py), releases, processes (/proc), runs, stopping, logreader (the
`log` verb), verbs (one function per verb), main (the entry). supervisor (the run's
wrapper, which restarts a crashed trainer: run.retry) is not part of the bundle: it
travels with the crash detector in a program of its own (dflashctl/ops/recovery.py).

Runs on Python 3.6 and later (f-strings, no annotations, no walrus, no
`from __future__ import annotations`), since the container's python may be older
than ours: tests/test_agent_bundle.py checks it, and that only the standard library
is imported.
"""
