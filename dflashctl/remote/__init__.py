"""Everything that talks to a machine.

transport/: running commands and moving files (local, SSH with verified host keys);
pct and proxmox (with proxmox_tls): the container through `pct` and the Proxmox API;
deploy_target: where the trainer runs (a container through pct, or the host itself);
connect: from a Config to the target and the API; nodes: the fleet (one target per
node, one SSH connection per host), work on every node at once (one node too), and
NodesFailed, every node's outcome as data; agent_client: the agent bundled and called (agent_messages: its messages, typed).
"""
