"""Bytes each agent call sends: a poll (the bootstrap alone), a call with the bundle,
and the log reader's command line. No host needed.

    .venv/bin/python bench/agent_payload.py
"""

from __future__ import annotations

from dflashctl.remote import agent_client


def main() -> None:
    poll = {"workdir": "/root/dflash", "run_id": "20261130-180000-abcd"}
    rows = [
        (
            "runs poll, agent kept (bootstrap only)",
            agent_client.agent_input("runs", poll, with_bundle=False),
        ),
        ("call with the bundle attached", agent_client.agent_input("runs", poll)),
        ("the bundle itself, uncompressed", agent_client.bundle_source().encode()),
    ]
    for name, data in rows:
        print(f"{len(data):>8} B  {name}")
    argv = agent_client.log_reader_argv(
        "python3", "/root/dflash", poll["run_id"], 0, -1, once=False
    )
    print(f"{sum(len(a) + 1 for a in argv):>8} B  log reader command line")


if __name__ == "__main__":
    main()
