"""What the user sees; with dflashctl/commands/ and follow/, the only code that draws.

terminal: the one terminal facade (results on stdout, diagnostics on stderr); tables:
every table shown; charts: line charts in the terminal, plot_image: the same as a --png;
help: how --help reads; json_output: the one --json shape, json_schemas: its models and
the kept JSON Schemas (dflashctl/schemas/).
"""
