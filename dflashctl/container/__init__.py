"""GPU containers: make the container a run needs (`dflashctl container create`) and
repair the GPU passthrough that breaks (`dflashctl doctor --fix`).

host.py reads the node's GPUs (driver version, device majors) and edits its container
configs; ctconfig.py reads a container's config and says which devN entries it needs;
inside.py looks inside the container; create.py and repair.py plan and apply the
changes. Nothing here prints: the commands (commands/container.py, commands/doctor.py)
say what happens.
"""
