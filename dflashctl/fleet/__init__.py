"""stop, runs, status and doctor on every node of a multi-node config (issue 17).

One module per command; each talks to all nodes at once (dflashctl/nodes.py) and
reports one row (or group) per node. A node that cannot be reached never hides the
others: they still answer, and the command then fails naming that node (exit 3).
A config without `nodes:` never comes here: those commands run as they always did.
"""
