"""The operations, as logic that returns data: nothing here prints or draws.

deploy (deploy_plan, sync, archive, source_cache, releases, early_upload, setup_env,
launching, launch_command, recovery, and committing: the commit barrier's client),
restart, stop, pull, attach (exec and shell), status, doctor_checks and doctor_nodes,
stacks (flight_recorder). Each hands what it is doing to the reporting.Reporter its caller
passes; dflashctl/commands/ shows the result.
"""
