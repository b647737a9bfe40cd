"""dflash.yaml, read and checked before anything is contacted.

schema: the models, their validation and loading; base: what every section shares;
run, setup, nodes, crash_patterns: the sections with rules of their own; errors:
pydantic's errors as one-sentence ConfigErrors; yaml_source: the safe YAML loader that
remembers where each key and value was written (and its limits); cache: the validated
config kept between commands; private_files: cache files read back only if we wrote them.

Standard library only at import: early_upload reads private_files before the CLI loads.
"""
